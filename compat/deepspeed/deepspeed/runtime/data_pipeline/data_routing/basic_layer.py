"""``deepspeed.runtime.data_pipeline.data_routing.basic_layer``: ``RandomLayerTokenDrop`` is
shardwise.data.random_ltd.TokenDropLayer (plain PyTorch token gather/scatter)."""
from shardwise.data.random_ltd import TokenDropLayer as RandomLayerTokenDrop

__all__ = ["RandomLayerTokenDrop"]
