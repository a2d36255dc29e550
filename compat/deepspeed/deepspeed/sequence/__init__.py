"""``deepspeed.sequence``: AutoSP's names, as DeepSpeed's package exports them (the fusion adapters with
DeepSpeed's method names, from ``autosp_fusion``); ``layer``, ``auto_sp`` and ``autosp_vit`` are shardwise's
modules (shardwise.sequence.layer, shardwise.sequence.autosp.detect and .vit). The vocab-parallel
cross-entropy and FPDT are not provided."""
from deepspeed.sequence.autosp_fusion import (InternVLFusionAdapter, LlavaFusionAdapter,  # noqa: F401
                                              ModalityFusionSPAdapter, Qwen2VLFusionAdapter)
from shardwise.sequence.autosp import SPModelInfo, UlyssesSPViTAttention, auto_wrap_model_for_sp  # noqa: F401
from shardwise.sequence.autosp import detect_model_sp_info  # noqa: F401

__all__ = ["InternVLFusionAdapter", "LlavaFusionAdapter", "ModalityFusionSPAdapter", "Qwen2VLFusionAdapter",
           "SPModelInfo", "UlyssesSPViTAttention", "auto_wrap_model_for_sp", "detect_model_sp_info"]
