"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` path: ``parallel_state_sp`` (DeepSpeed's mpu module, views of
the grid) and ``ulysses_sp`` (shardwise's Ulysses sequence parallelism with DeepSpeed's return value) live here;
the implementation is ``shardwise.runtime.sequence_parallel``."""
