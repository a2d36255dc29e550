"""``deepspeed.runtime.activation_checkpointing`` (Megatron-DeepSpeed imports it from here)."""
