"""Sequence parallelism and long-sequence training (``deepspeed.runtime.sequence_parallel``)."""
