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
# DLRover's flash checkpoint imports grpc, psutil, pynvml, requests and packaging on import (benchmarks.gpu's
# peer rows). nvidia-resiliency-ext (and its imports defusedxml, pyyaml) for the row of Megatron's own local
# checkpoints (LocalCheckpointManager); with it installed, torch_dist async runs async_strategy "nvrx",
# megatron-core 0.19's default (without it, "mcore"). Its cp312 wheel is manylinux_2_31.
PACKAGES=(megatron-core==0.19.2 zlib-ng dlrover==0.6.1 deprecated wrapt grpcio psutil pynvml nvidia-ml-py
          requests urllib3 idna certifi charset-normalizer packaging
          pydantic pydantic-core annotated-types typing-inspection typing-extensions
          nvidia-resiliency-ext==0.4.1 defusedxml pyyaml)
mkdir -p "$DEST"
for package in "${PACKAGES[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DEST" "$package"
done
ls -1 "$DEST"
