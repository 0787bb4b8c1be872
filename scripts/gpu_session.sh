#!/usr/bin/env bash
# A lent GPU's whole session in one call (the device tool runs it in a copy of the checkout, with the
# wheels of scripts/gpu_wheels.sh carried in .whl/): install them, the checksum kernel's load in a fresh
# process, tests/gpu, the project's own GPU benchmark as committed, then the other copy paths' paired
# costs (scripts/gpu_paired_probe.py) in the time left. Everything it learns lands in $OUT as 5 files (the
# device tool brings back at most 8).
#
#   bash scripts/gpu_wheels.sh                    # here, with pip access
#   OUT=/tmp/out bash scripts/gpu_session.sh      # there (TESTS_S, BENCH_S, TOTAL_S cap the parts; PAIRED_PATHS)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pec_gpu_out}
TESTS_S=${TESTS_S:-90}
BENCH_S=${BENCH_S:-460}  # the benchmark is the measurement that counts; SIGINT at its limit keeps its rows
TOTAL_S=${TOTAL_S:-565}  # the paired probe gets what is left of this, leaving time to pack and copy the logs back
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
LOGS=$(mktemp -d /tmp/pec_session_XXXX)
mkdir -p "$OUT"
SITE=/tmp/pec_site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$LOGS/install.log" 2>&1
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
{ nvidia-smi; nproc; free -g; df -h /dev/shm
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$LOGS/machine.txt" 2>&1
# the checksum kernel's load alone in a fresh process, twice (the second finds Triton's cache warm)
for attempt in cold warm; do
  timeout 40 python3 scripts/kernel_load_profile.py > "$LOGS/kernel_load_$attempt.txt" 2>&1
done
timeout "$TESTS_S" python3 -m pytest tests/gpu -q -rs > "$LOGS/tests_gpu.log" 2>&1
echo "tests/gpu exit $? at $(elapsed) s" | tee -a "$OUT/summary.txt"
# BENCH_ARGS: e.g. --peers pec_all (the peers' rows from an earlier run on the same kind of GPU stand)
timeout -s INT -k 20 "$BENCH_S" python3 -m benchmarks.gpu --json "$OUT/gpu.json" ${BENCH_ARGS:-} \
  > "$LOGS/benchmark.log" 2>&1
echo "benchmarks.gpu exit $? at $(elapsed) s" | tee -a "$OUT/summary.txt"
left=$(( TOTAL_S - $(elapsed) ))
if [ "$left" -gt 45 ]; then  # the copy paths beside the default one, each a snapshot's cost paired within its run
  # (the benchmark's "paired" row is the default path's; runs differ by +-10% on an H200, pairs do not drift)
  PAIRED_PATHS=${PAIRED_PATHS:-kernel2,engine} timeout "$left" python3 scripts/gpu_paired_probe.py \
    > "$LOGS/paired.log" 2>&1
  echo "paired probe exit $? at $(elapsed) s ($left s allowed)" | tee -a "$OUT/summary.txt"
else
  echo "no time left for the paired probe ($left s)" | tee -a "$OUT/summary.txt"
fi
# every run's log and metrics (not the checkpoints beside them: gigabytes), then the session's own logs
(cd /tmp && tar -czf "$OUT/runs.tar.gz" pec_gpu_*/*.jsonl pec_gpu_*/*.json \
   $(ls pec_gpu_*/*.log pec_gpu_diag_*/*.log 2>/dev/null | grep -v peers.log) 2>/dev/null)
grep -h -B3 -A30 Traceback /tmp/pec_gpu_*/*.log /tmp/pec_gpu_diag_*/*.log 2>/dev/null | head -400 \
  > "$LOGS/tracebacks.txt"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
tail -n 4 "$LOGS/tests_gpu.log"; grep -E "^\[paired" "$LOGS/paired.log" 2>/dev/null | cut -c1-400
tail -n 40 "$LOGS/benchmark.log"
