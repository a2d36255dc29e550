"""``deepspeed.sequence.autosp_detector``: shardwise.sequence.autosp.detect under DeepSpeed's table names
(the same objects, so adding a class name to either teaches both)."""
from shardwise.sequence.autosp.detect import (LLM_ATTENTION_CLASSES, VISION_PROJECTION_NAMES,  # noqa: F401
                                              VIT_ATTENTION_CLASSES, VIT_HAS_CLS_TOKEN, SPModelInfo,
                                              detect_model_sp_info)

_VIT_ATTN_CLASSNAMES = VIT_ATTENTION_CLASSES
_VIT_HAS_CLS_TOKEN = VIT_HAS_CLS_TOKEN
_LLM_ATTN_CLASSNAMES = LLM_ATTENTION_CLASSES
_VISION_PROJ_KEYWORDS = VISION_PROJECTION_NAMES
