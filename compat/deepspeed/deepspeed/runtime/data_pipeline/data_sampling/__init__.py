"""``deepspeed.runtime.data_pipeline.data_sampling``: the offline data analyzer and the indexed dataset."""
