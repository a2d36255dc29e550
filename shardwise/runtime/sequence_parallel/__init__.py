"""Ulysses sequence parallelism for Hugging Face models (DeepSpeed's ``deepspeed.runtime.sequence_parallel``).

``ulysses_sp`` holds the attention adapter and the data-loader adapter, ``parallel_state_sp`` the
process groups (the ``mpu`` that ``UlyssesSPAttentionHF.register_with_transformers`` returns).
See docs/sequence-parallel.md.
"""
