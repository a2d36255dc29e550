"""AutoEP: expert parallelism for Hugging Face MoE models (``"expert_parallel": {"enabled": true, ...}``).

``initialize`` finds the MoE blocks of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3
(``presets``), and replaces each by an ``AutoEPMoE`` (``block``): the model's own router and routing
(``router``), this rank's share of the experts, tokens exchanged over the expert-parallel group without
dropping (``dispatch``). The engine then trains it as any MoE layer (``shardwise.moe.parallel``).
See docs/moe.md ("AutoEP").
"""

from shardwise.moe.autoep.block import AutoEPMoE
from shardwise.moe.autoep.replace import apply_autoep, check_sizes

__all__ = ["AutoEPMoE", "apply_autoep", "check_sizes"]
