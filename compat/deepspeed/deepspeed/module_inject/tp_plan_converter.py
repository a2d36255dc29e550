"""``deepspeed.module_inject.tp_plan_converter``: ``TPPlanConverter``, a Hugging Face ``tp_plan``
(``{"layers.*.q_proj": "colwise", ...}``) as DeepSpeed's ``TPLayerSpec`` list. shardwise's own AutoTP reads
``tp_plan`` directly (``shardwise.tensor_parallel.autotp.hf_tp_plan``); this converter gives DeepSpeed's
partition-config form of it."""
from __future__ import annotations

from typing import Dict, List, Optional

from .autotp_config import PartitionType, TPLayerSpec

__all__ = ["SUPPORTED_STYLES", "TPPlanConverter"]

# colwise_rep is the older name of colwise_gather_output; embedding_rowwise marks a tied embedding
SUPPORTED_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
                    "embedding_rowwise"}


class TPPlanConverter:
    @staticmethod
    def convert(hf_tp_plan: Dict[str, str]) -> Optional[List[TPLayerSpec]]:
        """One spec per plan entry (a wildcard pattern becomes a regex over ``...weight``); None for an empty
        plan. A style outside ``SUPPORTED_STYLES`` rejects the whole plan (ValueError): applying only part of
        it could split one half of a column/row pair."""
        if not hf_tp_plan:
            return None
        unsupported = {style for style in hf_tp_plan.values() if style.lower() not in SUPPORTED_STYLES}
        if unsupported:
            raise ValueError(f"HuggingFace tp_plan contains unsupported partition style(s): {sorted(unsupported)}. "
                             "Applying only the supported entries could shard one half of a column/row pair, so the "
                             "plan is rejected as a whole. Provide an explicit 'tensor_parallel.partition_config' "
                             "for this model instead.")
        specs = []
        for pattern, style in hf_tp_plan.items():
            regex = TPPlanConverter._wildcard_to_regex(pattern)
            style = style.lower()
            gather_output = grad_allreduce = False
            if style in ("colwise", "colwise_rep", "colwise_gather_output"):
                kind, gather_output = PartitionType.COLUMN, style != "colwise"
            elif style == "rowwise":
                kind = PartitionType.ROW
            elif style == "embedding_rowwise":
                kind = PartitionType.SKIP
            else:  # replicated_with_grad_allreduce: whole, its gradient summed over the group
                kind, grad_allreduce = PartitionType.SKIP, True
            regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
            specs.append(TPLayerSpec(patterns=[regex], partition_type=kind, gather_output=gather_output,
                                     grad_allreduce=grad_allreduce))
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        return ".*" + pattern.replace(".", r"\.").replace("*", ".*")
