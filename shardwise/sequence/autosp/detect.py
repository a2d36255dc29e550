"""Finding what AutoSP wraps in a multimodal model, by attention class name, and wrapping it.

``auto_wrap_model_for_sp(model, process_group)`` replaces every vision-encoder attention it knows
(``VIT_ATTENTION_CLASSES``) with ``UlyssesSPViTAttention`` in place. Language-model attention
(``LLM_ATTENTION_CLASSES``) is reported, not wrapped: Hugging Face attention takes ``hidden_states``,
and its sequence parallelism is ``shardwise.runtime.sequence_parallel.ulysses_sp`` (register it before
loading the model). The vision projection (``VISION_PROJECTION_NAMES``) is reported too: wrap it with a
fusion adapter (``shardwise.sequence.autosp.fusion``). Add a model's class names to the tables to
teach it a new architecture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from shardwise.sequence.autosp.vit import UlyssesSPViTAttention

logger = logging.getLogger(__name__)

# Hugging Face vision attention classes, and whether the model puts a CLS token first (unknown: True)
VIT_ATTENTION_CLASSES = {"ViTAttention", "CLIPAttention", "SiglipAttention", "InternVisionAttention",
                         "Qwen2VLVisionAttention", "Idefics2VisionAttention", "PaliGemmaVisionAttention"}
VIT_HAS_CLS_TOKEN = {"ViTAttention": True, "CLIPAttention": True, "SiglipAttention": False,
                     "InternVisionAttention": False, "Qwen2VLVisionAttention": False,
                     "Idefics2VisionAttention": False, "PaliGemmaVisionAttention": False}
LLM_ATTENTION_CLASSES = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "InternLM2Attention",
                         "GemmaAttention", "Phi3Attention", "GPTNeoXAttention", "FalconAttention", "MptAttention"}
VISION_PROJECTION_NAMES = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector",
                           "img_projection")


@dataclass
class SPModelInfo:
    """What ``detect_model_sp_info`` found: ``(dotted name, module)`` pairs."""

    vit_attn_modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    llm_attn_modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    vision_projection_module: tuple[str, torch.nn.Module] | None = None  # the outermost one


def detect_model_sp_info(model: torch.nn.Module) -> SPModelInfo:
    """The vision attention, language attention and vision projection modules of ``model``. Modules
    inside an ``UlyssesSPViTAttention`` are already wrapped and are left out."""
    info = SPModelInfo()
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        kind = type(module).__name__
        if isinstance(module, UlyssesSPViTAttention):
            wrapped.append(name)
        elif kind in VIT_ATTENTION_CLASSES:
            info.vit_attn_modules.append((name, module))
        elif kind in LLM_ATTENTION_CLASSES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(k in name for k in VISION_PROJECTION_NAMES):
            info.vision_projection_module = (name, module)
    return info


def auto_wrap_model_for_sp(model: torch.nn.Module, process_group) -> torch.nn.Module:
    """Wrap ``model``'s vision attention for sequence parallelism over ``process_group`` (in place; returns
    ``model``). Raises ``ValueError`` when it finds no attention it knows."""
    info = detect_model_sp_info(model)
    known = info.vit_attn_modules or info.llm_attn_modules
    if not known and not any(isinstance(m, UlyssesSPViTAttention) for m in model.modules()):
        raise ValueError(f"auto_wrap_model_for_sp: no attention module of {type(model).__name__} is one AutoSP "
                         "knows; add its class name to shardwise.sequence.autosp.detect.VIT_ATTENTION_CLASSES "
                         "(vision encoder) or LLM_ATTENTION_CLASSES (language model)")
    for name, module in info.vit_attn_modules:
        has_cls = VIT_HAS_CLS_TOKEN.get(type(module).__name__, True)
        _replace(model, name, UlyssesSPViTAttention(module, process_group, has_cls_token=has_cls))
    logger.info("AutoSP: wrapped %d vision attention module(s)", len(info.vit_attn_modules))
    for name, module in info.llm_attn_modules:
        logger.warning("AutoSP: language-model attention %r (%s) is not wrapped: its sequence parallelism is "
                       "UlyssesSPAttentionHF.register_with_transformers (shardwise.runtime.sequence_parallel."
                       "ulysses_sp)", name, type(module).__name__)
    if info.vision_projection_module is not None:
        logger.warning("AutoSP: vision projection %r is not wrapped: wrap it with a fusion adapter "
                       "(shardwise.sequence.autosp.fusion) so the fused sequence is sharded",
                       info.vision_projection_module[0])
    return model


def _replace(model: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
