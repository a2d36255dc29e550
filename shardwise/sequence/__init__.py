"""Sequence parallelism modules outside the Hugging Face integration (that one is
``shardwise.runtime.sequence_parallel.ulysses_sp``; docs/sequence-parallel.md).

* ``layer``: DeepSpeed's Megatron-era Ulysses module (``DistributedAttention``) and the exchanges the
  reference GPT uses;
* ``autosp``: AutoSP, sequence parallelism for vision and multimodal models (ViT attention, fusion adapters).
"""
