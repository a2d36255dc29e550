"""Mixture of experts: DeepSpeed's ``deepspeed.moe`` API (``layer.MoE``, ``utils``) and expert parallelism.

``layer.MoE`` routes tokens with DeepSpeed's gates (``sharded_moe``), exchanges them with an all-to-all
over the expert-parallel group, and runs the local experts (``experts``). The engine reduces expert
gradients over the expert-data-parallel group (``strategy``). See docs/moe.md.
"""
