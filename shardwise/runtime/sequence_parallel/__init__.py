"""Sequence parallelism and long-sequence training (DeepSpeed's ``deepspeed.runtime.sequence_parallel``).

``ulysses_sp`` holds the Ulysses attention adapter and the data-loader adapter, ``groups``
the process groups (the grid ``UlyssesSPAttentionHF.register_with_transformers`` returns, to pass to
``initialize(mpu=...)``),
``tiled`` the tiled MLP and logits+loss. See docs/sequence-parallel.md and docs/long-sequences.md.
"""
