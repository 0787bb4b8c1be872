#!/usr/bin/env bash
# Creates .venv with everything the CPU example and the tests need; idempotent and quiet when done.
# On machines without CUDA it installs torch==2.13.0 (CPU build); with CUDA the existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[bootstrap] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.megatron-pec-bootstrap
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[bootstrap] GPU found: install the torch build that matches your CUDA into .venv first" >&2
    echo "            (for example: .venv/bin/pip install torch), then run this script again" >&2
    exit 2
  fi
  echo "[bootstrap] installing torch==2.13.0 (CPU build)"
  "${pip[@]}" torch==2.13.0
fi
echo "[bootstrap] installing megatron-pec and test dependencies"
"${pip[@]}" -e ".[test]"
echo "$want" > "$stamp"
