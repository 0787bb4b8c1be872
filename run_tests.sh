#!/usr/bin/env bash
# The test command: sets up two virtual environments on a fresh machine and runs the suite.
#
#   .venv             megatron-core 0.16.1 (what pip picks on Python 3.11): the whole suite, the
#                     fault-injection campaign's fast subset and Megatron-LM's own training loop
#                     of the oldest and the newest supported release included;
#   .venv-mcore019    megatron-core 0.19.2, the newest release: the tests that build megatron-core
#                     models, optimizers and DDP (MCORE019_TESTS below) and the unit tests.
#
# Arguments go to the first run only and skip the second (e.g. the full campaign:
# ./run_tests.sh -m campaign). PEC_SKIP_MCORE019=1 skips the second environment.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The four reshard cases (~22 s each on 2 cores) are split between the releases: the newest reshards the
# plain state up and down (2 to 4 ranks, 4 to 2), the oldest with an EP change and with partial experts.
RESHARD=tests/test_reshard.py::test_restore_onto_another_parallel_layout
RESHARD_MCORE019=("$RESHARD[2to4]" "$RESHARD[4to2]")
MCORE019_TESTS=(tests/test_roundtrip.py tests/test_pec_restore.py tests/test_load_options.py
                tests/test_token_counts.py tests/test_cpu_standins.py tests/test_layout.py
                tests/test_export.py "${RESHARD_MCORE019[@]}" tests/test_previous_format.py
                tests/test_state_parity.py::test_example_trainer_restore_equals_the_state_it_saved
                tests/test_state_kinds.py::test_grad_scaler_before_the_first_step_rerun_state_machine_and_override_iteration)
bash scripts/bootstrap.sh
if [[ $# -gt 0 || ${PEC_SKIP_MCORE019:-0} == 1 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
VENV=.venv-mcore019 MEGATRON_CORE=0.19.2 bash scripts/bootstrap.sh
# Every part runs whatever the parts before it did; one summary at the end, failing if any part failed.
summary=()
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
part() {  # part NAME PYTHON PYTEST-ARGS...
  local name=$1 python=$2 start=$SECONDS rc
  shift 2
  echo "== $name"
  set +e
  "$python" -m pytest -q "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  summary+=("$([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)") | $name | $(tail -n 1 "$log") | $((SECONDS - start)) s")
  [[ $rc == 0 ]] || failed=1
}
part "megatron-core 0.16.1 (.venv): the whole suite" .venv/bin/python --durations=25 \
  "${RESHARD_MCORE019[@]/#/--deselect=}"
part "megatron-core 0.19.2 (.venv-mcore019): unit tests" .venv-mcore019/bin/python \
  -m "not multiprocess and not campaign" tests
part "megatron-core 0.19.2 (.venv-mcore019): megatron-core model tests" .venv-mcore019/bin/python \
  -m "multiprocess and not campaign" "${MCORE019_TESTS[@]}"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
