"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers, by name only (``fused_optimizer``,
``unfused_optimizer``); shardwise does loss scaling in the engine's precision step (the config's fp16 block)."""
