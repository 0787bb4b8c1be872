#!/usr/bin/env bash
# The main job.
#  * No MEGATRON_LM set (or no GPU): trains a small GPT-MoE with real megatron-core on 2 CPU ranks
#    (gloo) on the Python standard library's text, with PEC on, and demonstrates a node failure
#    and its recovery. Sets up .venv on first use. Extra arguments go to examples/gpt_moe/cpu_demo.py
#    (--help lists them).
#  * MEGATRON_LM=<patched Megatron-LM checkout> on a GPU machine: launches Megatron-LM's
#    pretrain_gpt.py with the same PEC flags (see docs/megatron-lm.md and
#    examples/megatron_lm/launch_pretrain_gpt.sh for NNODES, NODE_RANK, MASTER_ADDR, DATA_PATH, ...).
set -euo pipefail
cd "$(dirname "$0")"
if [[ -n "${MEGATRON_LM:-}" ]]; then
  exec examples/megatron_lm/launch_pretrain_gpt.sh "$@"
fi
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python examples/gpt_moe/cpu_demo.py "$@"
