#!/usr/bin/env bash
# A lent GPU's diagnostic session in one call (issue 41): where the example's K=all step overhead comes from.
# The copy probe (copy engine against a copy by the GPU's cores), the overhead probe (traced steps, a relaunched
# restore), then tests/gpu. Everything lands in $OUT (at most 8 files come back).
#
#   bash scripts/gpu_wheels.sh                            # here, with pip access
#   OUT=/tmp/out bash scripts/gpu_probe_session.sh        # there, carrying .whl
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
timeout 120 python3 scripts/gpu_copy_probe.py > "$OUT/copy_probe.log" 2>&1
echo "copy probe exit $? at $(( $(date +%s) - start )) s" >> "$OUT/session.log"
timeout 300 python3 scripts/gpu_overhead_probe.py > "$OUT/diag.log" 2>&1
echo "overhead probe exit $? at $(( $(date +%s) - start )) s" >> "$OUT/session.log"
left=$(( ${TOTAL_S:-540} - ($(date +%s) - start) ))
timeout "$left" python3 -m pytest tests/gpu -q -rs -x > "$OUT/tests_gpu.log" 2>&1
echo "tests/gpu exit $? at $(( $(date +%s) - start )) s ($left s allowed)" >> "$OUT/session.log"
tail -n 4 "$OUT/session.log"
