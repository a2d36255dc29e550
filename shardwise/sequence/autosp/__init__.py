"""AutoSP: sequence parallelism for vision and multimodal models (DeepSpeed's ``deepspeed.sequence.auto_sp``,
``autosp_vit``, ``autosp_fusion``). See docs/sequence-parallel.md.

* ``UlyssesSPViTAttention``: gathers the patches around a vision encoder's attention (``vit``);
* ``LlavaFusionAdapter``, ``InternVLFusionAdapter``, ``Qwen2VLFusionAdapter`` (``ModalityFusionSPAdapter``
  for others): splice the visual tokens into the text and shard the fused sequence (``fusion``);
* ``auto_wrap_model_for_sp``: wraps a model's vision attention by class name (``detect``).
"""

from shardwise.sequence.autosp.detect import SPModelInfo, auto_wrap_model_for_sp, detect_model_sp_info
from shardwise.sequence.autosp.fusion import (InternVLFusionAdapter, LlavaFusionAdapter, ModalityFusionSPAdapter,
                                              Qwen2VLFusionAdapter)
from shardwise.sequence.autosp.vit import UlyssesSPViTAttention

__all__ = ["InternVLFusionAdapter", "LlavaFusionAdapter", "ModalityFusionSPAdapter", "Qwen2VLFusionAdapter",
           "SPModelInfo", "UlyssesSPViTAttention", "auto_wrap_model_for_sp", "detect_model_sp_info"]
