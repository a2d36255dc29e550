"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library names onto shardwise.data
(curriculum schedules, the offline data analyzer, Megatron's indexed dataset, random-LTD).
See docs/data-efficiency.md."""
