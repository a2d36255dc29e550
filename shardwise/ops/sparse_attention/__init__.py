"""Block-sparse attention: DeepSpeed's ``deepspeed.ops.sparse_attention`` layouts and module.

``SparsityConfig`` and its subclasses build block layouts; ``SparseSelfAttention`` computes
attention on the layout's blocks only, with ``torch.nn.attention.flex_attention``.
See docs/long-sequences.md.
"""

from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                            DenseSparsityConfig, FixedSparsityConfig,
                                                            LocalSlidingWindowSparsityConfig, SparsityConfig,
                                                            VariableSparsityConfig, sparsity_config_from_dict)

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
           "SparseSelfAttention", "sparsity_config_from_dict"]
