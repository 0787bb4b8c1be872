#!/usr/bin/env bash
# The test command: sets up two virtual environments on a fresh machine and runs the suite.
#
#   .venv             megatron-core 0.16.1 (what pip picks on Python 3.11): the whole suite but the tests
#                     of megatron-pec's own restore logic (NEWEST_ONLY below), the fault-injection
#                     campaign's fast subset and Megatron-LM's own training loop of the oldest and the
#                     newest supported release included;
#   .venv-mcore019    megatron-core 0.19.2, the newest release: the tests that build megatron-core
#                     models, optimizers and DDP (MCORE019_TESTS below) and the unit tests that touch
#                     Megatron (not MEGATRON_FREE below).
#
# Arguments go to the first run only and skip the second (e.g. the full campaign: ./run_tests.sh -m campaign;
# the cases the default run covers with a sibling: ./run_tests.sh -m slow). PEC_SKIP_MCORE019=1 skips the
# second environment.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The four reshard cases (~22 s each on 2 cores) are split between the releases: the newest reshards the
# plain state up and down (2 to 4 ranks, 4 to 2), the oldest with an EP change and with partial experts.
RESHARD=tests/test_reshard.py::test_restore_onto_another_parallel_layout
RESHARD_MCORE019=("$RESHARD[2to4]" "$RESHARD[4to2]")
# Tests of megatron-pec's own restore logic (PEC versions, load options, export, the previous format) run on
# the newest release only; those that depend on megatron-core's models, optimizers and DDP run on both.
NEWEST_ONLY=(tests/test_pec_restore.py tests/test_load_options.py tests/test_export.py tests/test_previous_format.py)
MCORE019_TESTS=(tests/test_roundtrip.py "${NEWEST_ONLY[@]}" tests/test_token_counts.py tests/test_cpu_standins.py
                tests/test_expert_params.py "${RESHARD_MCORE019[@]}"
                tests/test_state_parity.py::test_example_trainer_restore_equals_the_state_it_saved
                tests/test_state_kinds.py::test_grad_scaler_before_the_first_step_rerun_state_machine_and_override_iteration)
# Unit tests that import no Megatron (nor run anything that does; test_fused_sums' workers take only the CPU
# stand-ins of torch.cuda) give the same result on either release: they run once, on the oldest.
MEGATRON_FREE=(tests/test_agent.py tests/test_agent_link.py tests/test_budget.py tests/test_checkpoint_dir.py
               tests/test_coalesce.py tests/test_copy_waves.py tests/test_expert_values.py tests/test_format.py
               tests/test_fused_sums.py tests/test_landing.py tests/test_loader.py tests/test_node_memory.py
               tests/test_numpy_rng.py tests/test_pec_book.py tests/test_python_rng.py
               tests/test_peers.py tests/test_phases.py tests/test_pinning.py tests/test_plan_agreement.py
               tests/test_plt.py tests/test_policy.py tests/test_protocol.py tests/test_reduced_record.py
               tests/test_save_history.py tests/test_save_steps.py tests/test_small_state_record.py
               tests/test_structure.py tests/test_sum64.py)
# The two environments are built side by side (installing is mostly one core's work; bootstrap.sh takes
# turns where both write into the checkout).
newest_setup=
if [[ $# -eq 0 && ${PEC_SKIP_MCORE019:-0} != 1 ]]; then
  setup_log=$(mktemp)
  VENV=.venv-mcore019 MEGATRON_CORE=0.19.2 bash scripts/bootstrap.sh > "$setup_log" 2>&1 &
  newest_setup=$!
fi
bash scripts/bootstrap.sh
# The linter first (pyproject.toml's [tool.ruff]): any finding fails the run.
.venv/bin/ruff check --output-format concise .
if [[ -z $newest_setup ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
if ! wait "$newest_setup"; then
  cat "$setup_log" >&2
  exit 1
fi
cat "$setup_log"
rm -f "$setup_log"
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
  "${RESHARD_MCORE019[@]/#/--deselect=}" "${NEWEST_ONLY[@]/#/--ignore=}"
part "megatron-core 0.19.2 (.venv-mcore019): unit tests" .venv-mcore019/bin/python \
  -m "not multiprocess and not campaign and not slow" "${MEGATRON_FREE[@]/#/--ignore=}" tests
part "megatron-core 0.19.2 (.venv-mcore019): megatron-core model tests" .venv-mcore019/bin/python \
  -m "multiprocess and not campaign and not slow" "${MCORE019_TESTS[@]}"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
