#!/usr/bin/env bash
# Creates a virtual environment with everything the CPU example and the tests need; idempotent and
# quiet when done. On machines without CUDA it installs torch==2.13.0 (CPU build); with CUDA the
# existing torch is kept.
#
#   scripts/bootstrap.sh                     .venv, with the megatron-core pip picks (0.16.1 on Python 3.11)
#   VENV=.venv-mcore019 MEGATRON_CORE=0.19.2 scripts/bootstrap.sh
#                                            a second environment with that megatron-core release
#
# megatron-core >= 0.17 declares Python >= 3.12, yet its cp311 wheels work: MEGATRON_CORE installs
# one with --ignore-requires-python --no-deps (numpy and packaging first), plus triton, which its
# `import megatron.core` needs without declaring it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-}
if [[ ! -x $VENV/bin/python ]]; then
  echo "[bootstrap] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.megatron-pec-bootstrap
want=$( (cat pyproject.toml setup.py scripts/bootstrap.sh megatron_pec/integrity/*.c; echo "$MEGATRON_CORE") | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[bootstrap] GPU found: install the torch build that matches your CUDA into $VENV first" >&2
    echo "            (for example: $VENV/bin/pip install torch), then run this script again" >&2
    exit 2
  fi
  echo "[bootstrap] installing torch==2.13.0 (CPU build)"
  "${pip[@]}" torch==2.13.0
fi
if [[ -n $MEGATRON_CORE ]]; then
  echo "[bootstrap] installing megatron-core==$MEGATRON_CORE into $VENV"
  "${pip[@]}" numpy packaging triton
  "${pip[@]}" --ignore-requires-python --no-deps "megatron-core==$MEGATRON_CORE"
fi
echo "[bootstrap] installing megatron-pec and test dependencies into $VENV"
# (one environment at a time where flock is at hand: the editable install writes megatron_pec.egg-info into
# the checkout, and run_tests.sh builds both environments at once)
locked=()
command -v flock > /dev/null && locked=(flock .)
"${locked[@]}" "${pip[@]}" -e ".[test]"
if [[ -n $MEGATRON_CORE ]]; then
  have=$("$VENV/bin/python" -W ignore -c "import megatron.core as m; print(m.__version__)" 2>/dev/null)
  [[ $have == "$MEGATRON_CORE" || $have == "$MEGATRON_CORE"+* ]] || { echo "[bootstrap] expected megatron-core $MEGATRON_CORE, got $have" >&2; exit 1; }
fi
echo "$want" > "$stamp"
