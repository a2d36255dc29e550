"""``deepspeed.ops.transformer.transformer``: ``DeepSpeedTransformerLayer`` / ``DeepSpeedTransformerConfig`` are
shardwise.models.transformer_layer's ``TransformerLayer`` / ``TransformerLayerConfig`` (DeepSpeed's config
fields, parameter names and forward math, in PyTorch rather than CUDA kernels)."""
from shardwise.models.transformer_layer import TransformerLayer as DeepSpeedTransformerLayer
from shardwise.models.transformer_layer import TransformerLayerConfig as DeepSpeedTransformerConfig


class TransformerConfig:
    """DeepSpeed's base config class (the eight positional fields)."""

    def __init__(self, batch_size, hidden_size, intermediate_size, heads, attn_dropout_ratio, hidden_dropout_ratio,
                 num_hidden_layers, initializer_range):
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


__all__ = ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig", "TransformerConfig"]
