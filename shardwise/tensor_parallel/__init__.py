"""Tensor parallelism: Megatron-style layers, the collectives between them, vocab-parallel
cross-entropy and the RNG tracker (docs/tensor-parallel.md); AutoTP for Hugging Face models
(``autotp``, docs/autotp.md).

Contract with the rest of shardwise: a tensor-sharded parameter has ``tensor_model_parallel=True``,
``partition_dim`` and ``partition_stride=1``; any other parameter is replicated across tensor ranks.
A parameter with ``sequence_parallel=True`` (norms inside a sequence-parallel region) has a gradient
that is a partial sum over the tensor ranks; the engine all-reduces it over the tensor group.
"""

from shardwise.tensor_parallel.autotp import AutoTP, autotp_hook, shard_model, tp_model_init
from shardwise.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardwise.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              is_tensor_parallel, param_is_not_tensor_parallel_duplicate,
                                              set_tensor_model_parallel_attributes)
from shardwise.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                gather_from_sequence_parallel_region,
                                                gather_from_tensor_model_parallel_region,
                                                reduce_from_tensor_model_parallel_region,
                                                reduce_scatter_to_sequence_parallel_region,
                                                scatter_to_sequence_parallel_region,
                                                scatter_to_tensor_model_parallel_region)
from shardwise.tensor_parallel.random import (CudaRNGStatesTracker, get_cuda_rng_tracker,
                                              model_parallel_cuda_manual_seed, model_parallel_reconfigure_tp_seed)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "set_tensor_model_parallel_attributes",
           "param_is_not_tensor_parallel_duplicate", "is_tensor_parallel", "CudaRNGStatesTracker",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "autotp_hook", "AutoTP", "shard_model", "tp_model_init"]

