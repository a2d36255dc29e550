"""``deepspeed.runtime.constants``: the defaults DeepSpeed's tests and scripts read, taken from
shardwise's config model so the two cannot drift."""
from shardwise.config.model import ShardwiseConfig

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = ShardwiseConfig.model_fields["gradient_clipping"].default
