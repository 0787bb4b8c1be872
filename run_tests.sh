#!/usr/bin/env bash
# The test command: sets up two virtual environments on a fresh machine, runs ruff, then the suite.
#
#   .venv             megatron-core 0.16.1 (what pip picks on Python 3.11): every test but those marked
#                     newest_only (megatron-pec's own restore logic), the fault campaign's fast subset and
#                     Megatron-LM's own training loop of the oldest and the newest supported release included;
#   .venv-mcore019    megatron-core 0.19.2, the newest release: the unit tests that touch Megatron (all but
#                     megatron_free), and the tests that build megatron-core models, optimizers and DDP marked
#                     both_releases or newest_only.
#
# Tests are chosen by their markers (pyproject.toml; docs/testing.md says what each needs). Arguments go to the
# first run only and skip the second (e.g. the full campaign: ./run_tests.sh -m campaign; the cases the default
# run covers with a sibling: ./run_tests.sh -m slow). PEC_SKIP_MCORE019=1 skips the second environment.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
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
  -m "not campaign and not slow and not newest_only"
part "megatron-core 0.19.2 (.venv-mcore019): unit tests" .venv-mcore019/bin/python \
  -m "not multiprocess and not campaign and not slow and not megatron_free"
part "megatron-core 0.19.2 (.venv-mcore019): megatron-core model tests" .venv-mcore019/bin/python \
  -m "multiprocess and (both_releases or newest_only) and not campaign and not slow"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
