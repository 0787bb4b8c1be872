#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine, then runs the suite (the fault-injection
# campaign's fast subset included; the full campaign is: ./run_tests.sh -m campaign).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q "$@"
