#!/usr/bin/env bash
# A lent GPU's diagnostic session in one call (issue 41): what a K=all snapshot costs the example's step, by
# copy path. tests/gpu first (both copy paths bit for bit), then the overhead probe: no checkpoints, the
# checksum kernel's copy on PROBE_PROGRAMS programs, the copy engine; each run's iterations 21-22 traced.
# Everything lands in $OUT (at most 8 files come back). ~300 s on an H200.
#
#   bash scripts/gpu_wheels.sh                            # here, with pip access
#   OUT=/tmp/out bash scripts/gpu_probe_session.sh        # there, carrying .whl
#
# The copy probe alone (copy engine against a Triton copy, no Megatron, ~25 s): python3 scripts/gpu_copy_probe.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pec_gpu_out}
mkdir -p "$OUT"
start=$(date +%s)
SITE=/tmp/pec_site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/session.log" 2>&1
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >> "$OUT/session.log" 2>&1
timeout 110 python3 -m pytest tests/gpu -q -rs > "$OUT/tests_gpu.log" 2>&1
echo "tests/gpu exit $? at $(( $(date +%s) - start )) s" >> "$OUT/session.log"
left=$(( ${TOTAL_S:-480} - ($(date +%s) - start) ))
PROBE_PARTS=${PROBE_PARTS:-base,kernel,engine} PROBE_PROGRAMS=${PROBE_PROGRAMS:-4,8,16} OUT=$OUT \
  timeout "$left" python3 scripts/gpu_overhead_probe.py > "$OUT/diag.log" 2>&1
echo "overhead probe exit $? at $(( $(date +%s) - start )) s" >> "$OUT/session.log"
grep -E "^\[diag" "$OUT/diag.log" | cut -c1-300
tail -n 3 "$OUT/session.log"
