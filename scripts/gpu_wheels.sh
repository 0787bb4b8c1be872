#!/usr/bin/env bash
# Wheels for a GPU machine without a package index (Python 3.12, torch already there): megatron-core,
# zlib-ng, DLRover, nvidia-resiliency-ext and their imports for the peer rows of benchmarks.gpu, and what
# Megatron-LM's own loop needs. Run on a machine with pip access; carry the folder (ignored by git) and install
# it there:
#
#   bash scripts/gpu_wheels.sh                      # -> .whl/
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Then `python -m benchmarks.gpu` (and ../shared/gpu/check.sh with WHEELS=.whl).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
# pytest for tests/gpu (scripts/gpu_session.sh). DLRover's flash checkpoint imports grpc, psutil, pynvml,
# requests and packaging on import (benchmarks.gpu's peer rows).
PACKAGES=(megatron-core==0.19.2 zlib-ng pytest pluggy iniconfig dlrover==0.6.1 deprecated wrapt grpcio psutil
          pynvml nvidia-ml-py requests urllib3 idna certifi charset-normalizer packaging
          pydantic pydantic-core annotated-types typing-inspection typing-extensions defusedxml pyyaml)
# nvidia-resiliency-ext (its imports: defusedxml, pyyaml, above) for the row of Megatron's own local checkpoints
# (LocalCheckpointManager); with it installed, torch_dist async runs async_strategy "nvrx", megatron-core 0.19's
# default (without it, "mcore"). At least 0.6.0: megatron-core 0.19.2 asserts that version on import wherever
# nvidia_resiliency_ext is importable (0.4.1 has no __version__: `import megatron.core` fails), so an index
# without it (some mirrors stop at 0.4.1) leaves it out, and the Megatron local row says it is not importable.
OPTIONAL=("nvidia-resiliency-ext>=0.6.0")
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "$1"
}
mkdir -p "$DEST"
for package in "${PACKAGES[@]}"; do
  download "$package"
done
for package in "${OPTIONAL[@]}"; do
  download "$package" || echo "gpu_wheels.sh: $package is not on this index: left out" >&2
done
ls -1 "$DEST"
