#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with partial-experts flash checkpointing (PEC).
#
# The cluster mode of ./run_pretrain.sh: it execs this script when MEGATRON_LM points
# at a Megatron-LM checkout (core_v0.16.1 … core_v0.19.0) patched with patches/apply.sh and GPUs
# are present. Run it once per node (e.g. from srun/mpirun or by hand on each node).
#
# Required environment:
#   MEGATRON_LM        patched Megatron-LM checkout
#   DATA_PATH          Megatron indexed dataset prefix(es), e.g. /data/owt_text_document
#   tokenizer, one of: VOCAB_FILE + MERGE_FILE      (GPT2BPETokenizer, the default)
#                      TOKENIZER_MODEL [TOKENIZER_TYPE, default HuggingFaceTokenizer]
# Optional environment (defaults in brackets):
#   NNODES [1] NODE_RANK [0] MASTER_ADDR [localhost] MASTER_PORT [6000]
#   GPUS_PER_NODE [number of GPUs nvidia-smi lists]
#   TP_SIZE [1] PP_SIZE [1] EP_SIZE [1]
#   NUM_LAYERS [12] HIDDEN_SIZE [768] NUM_HEADS [12] NUM_EXPERTS [8] TOPK [2]
#   SEQ_LENGTH [1024] MICRO_BATCH_SIZE [8] GLOBAL_BATCH_SIZE [256] TRAIN_ITERS [20000] LR [6e-4]
#   LR_WARMUP_ITERS [200, or a tenth of TRAIN_ITERS for short runs: Megatron wants it below TRAIN_ITERS]
#   CKPT_DIR [./checkpoints/gpt2-moe-small]  SAVE_INTERVAL [100]  (persistent checkpoints)
#   PEC_SNAPSHOT_K [4] PEC_PERSIST_K [1] PEC_SELECTION [sequential]
# Every argument is passed through to pretrain_gpt.py; a flag given there overrides
# the same flag set here (argparse keeps the last value).
#
# Without Transformer Engine (and apex) Megatron-LM needs its local implementations; this script adds
# them when `import transformer_engine` fails: --transformer-impl local --no-persist-layer-norm
# --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion.
set -euo pipefail

die() { echo "launch_pretrain_gpt.sh: $1" >&2; exit "${2:-2}"; }

[[ -n "${MEGATRON_LM:-}" ]] || die "MEGATRON_LM is not set: point it at a Megatron-LM checkout (core_v0.16.1 … core_v0.19.0) patched with patches/apply.sh"
[[ -f "$MEGATRON_LM/pretrain_gpt.py" && -f "$MEGATRON_LM/megatron/training/training.py" ]] \
    || die "MEGATRON_LM=$MEGATRON_LM is not a Megatron-LM checkout (no pretrain_gpt.py / megatron/training/training.py)"
# Without the patch Megatron would silently write its own checkpoints and reject --pec-* flags.
grep -q megatron_pec "$MEGATRON_LM/megatron/training/training.py" && grep -q megatron_pec "$MEGATRON_LM/pretrain_gpt.py" \
    || die "Megatron-LM at $MEGATRON_LM is not patched for megatron-pec: run patches/apply.sh $MEGATRON_LM"

[[ -n "${DATA_PATH:-}" ]] || die "DATA_PATH is not set: give the prefix of a Megatron indexed dataset (the path without .bin/.idx), see docs/megatron-lm.md"
if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "$TOKENIZER_MODEL")
elif [[ -n "${VOCAB_FILE:-}" && -n "${MERGE_FILE:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
else
    die "no tokenizer: set VOCAB_FILE and MERGE_FILE (GPT-2 BPE) or TOKENIZER_MODEL (with TOKENIZER_TYPE)"
fi

if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$GPUS_PER_NODE" -gt 0 ]] || die "no GPU found (nvidia-smi lists none): set GPUS_PER_NODE, or use ./run_pretrain.sh without MEGATRON_LM for the CPU mode"
fi

# megatron_pec from this repository, megatron from the checkout.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO_ROOT:$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/gpt2-moe-small}

DISTRIBUTED_ARGS=(
    --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
    --nproc_per_node "$GPUS_PER_NODE"
)
# GPT2-MoE-Small, the PEC paper's model: GPT-2 small with 8 experts, top-2 routing.
MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-12}" --hidden-size "${HIDDEN_SIZE:-768}"
    --num-attention-heads "${NUM_HEADS:-12}" --ffn-hidden-size $((4 * ${HIDDEN_SIZE:-768}))
    --seq-length "${SEQ_LENGTH:-1024}" --max-position-embeddings "${SEQ_LENGTH:-1024}"
    --num-experts "${NUM_EXPERTS:-8}" --moe-router-topk "${TOPK:-2}"
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP_SIZE:-1}" --pipeline-model-parallel-size "${PP_SIZE:-1}"
    --expert-model-parallel-size "${EP_SIZE:-1}" --use-distributed-optimizer
)
TRAIN_ITERS=${TRAIN_ITERS:-20000}
# Megatron asserts unless the warmup is shorter than the run.
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( TRAIN_ITERS > 2000 ? 200 : TRAIN_ITERS / 10 ))}
(( LR_WARMUP_ITERS < TRAIN_ITERS )) || die "LR_WARMUP_ITERS=$LR_WARMUP_ITERS must be below TRAIN_ITERS=$TRAIN_ITERS"
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-8}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}"
    --train-iters "$TRAIN_ITERS" --lr "${LR:-6e-4}" --min-lr 6e-5 --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.02 --bf16
)
IMPL_ARGS=()
if ! "${PYTHON:-python3}" -c "import transformer_engine" 2>/dev/null; then
    echo "launch_pretrain_gpt.sh: no Transformer Engine: using Megatron-LM's local implementations" >&2
    IMPL_ARGS=(--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
               --no-masked-softmax-fusion --no-bias-dropout-fusion)
fi
read -ra DATA_PREFIXES <<< "$DATA_PATH"  # several prefixes (with weights) are allowed
DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 949,50,1 "${TOKENIZER_ARGS[@]}")
# Snapshot to node memory every iteration (non-persistent), persist every SAVE_INTERVAL.
CHECKPOINT_ARGS=(
    --save "$CKPT_DIR" --load "$CKPT_DIR"
    --save-interval "${SAVE_INTERVAL:-100}" --non-persistent-save-interval 1
    --pec-snapshot-k "${PEC_SNAPSHOT_K:-4}" --pec-persist-k "${PEC_PERSIST_K:-1}"
    --pec-selection "${PEC_SELECTION:-sequential}"
)
LOGGING_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10)

echo "launch_pretrain_gpt.sh: node ${NODE_RANK:-0}/${NNODES:-1}, $GPUS_PER_NODE GPUs, checkpoints in $CKPT_DIR" >&2
exec torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_LM/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${IMPL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
