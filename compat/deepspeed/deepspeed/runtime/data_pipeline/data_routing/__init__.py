"""``deepspeed.runtime.data_pipeline.data_routing``: random layer-wise token dropping (random-LTD)."""
