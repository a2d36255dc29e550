"""Sequence parallelism and long-sequence training (DeepSpeed's ``deepspeed.runtime.sequence_parallel``).

``ulysses_sp`` holds the Ulysses attention adapter and the data-loader adapter, ``parallel_state_sp``
the process groups (the ``mpu`` that ``UlyssesSPAttentionHF.register_with_transformers`` returns),
``tiled`` the tiled MLP and logits+loss. See docs/sequence-parallel.md and docs/long-sequences.md.
"""
