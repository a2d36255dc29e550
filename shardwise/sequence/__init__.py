"""``deepspeed.sequence``: DeepSpeed's Megatron-era Ulysses module (``layer.DistributedAttention``).

For Hugging Face models use ``shardwise.runtime.sequence_parallel.ulysses_sp`` (docs/sequence-parallel.md).
"""
