"""megatron-pec: partial-experts flash checkpoints for Megatron MoE training."""
