#!/usr/bin/env bash
# A lent GPU's whole session in one call (the device tool runs it in a copy of the checkout, with the
# wheels of scripts/gpu_wheels.sh carried in .whl/): install them, the project's own GPU benchmark as
# committed, then the GPU tests in the time left. Everything it learns lands in $OUT.
#
#   bash scripts/gpu_wheels.sh                    # here, with pip access
#   OUT=/tmp/out bash scripts/gpu_session.sh      # there (BENCH_S / TOTAL_S cap the parts)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pec_gpu_out}
BENCH_S=${BENCH_S:-470}  # the benchmark is the measurement that counts: it goes first
TOTAL_S=${TOTAL_S:-585}  # the tests get what is left of this, leaving time to copy the logs back
start=$(date +%s)
mkdir -p "$OUT"
SITE=/tmp/pec_site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
{ nvidia-smi; nproc; free -g; df -h /dev/shm
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
# the checksum kernel's load alone in a fresh process, twice (the second finds Triton's cache warm): where
# a relaunched trainer's load spends its time
for attempt in cold warm; do
  timeout 60 python3 scripts/kernel_load_profile.py > "$OUT/kernel_load_$attempt.txt" 2>&1
done
# BENCH_ARGS: e.g. --peers pec_all (the peers' rows from an earlier run on the same kind of GPU stand)
timeout "$BENCH_S" python3 -m benchmarks.gpu --json "$OUT/gpu.json" ${BENCH_ARGS:-} > "$OUT/benchmark.log" 2>&1
echo "benchmarks.gpu exit $? after $(( $(date +%s) - start )) s" >> "$OUT/benchmark.log"
# one file of every run's log and metrics (not the checkpoints beside them: gigabytes)
(cd /tmp && tar -czf "$OUT/runs.tar.gz" pec_gpu_*/*.jsonl pec_gpu_*/*.json \
   $(ls pec_gpu_*/*.log | grep -v peers.log) 2>/dev/null)
grep -h -B3 -A30 Traceback /tmp/pec_gpu_*/*.log 2>/dev/null | head -400 > "$OUT/tracebacks.txt"
left=$(( TOTAL_S - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest tests/gpu -q -rs > "$OUT/tests_gpu.log" 2>&1
  echo "pytest tests/gpu exit $? ($left s allowed)" >> "$OUT/tests_gpu.log"
else
  echo "no time left for tests/gpu ($left s)" > "$OUT/tests_gpu.log"
fi
tail -n 3 "$OUT/benchmark.log" "$OUT/tests_gpu.log"
