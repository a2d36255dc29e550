"""``deepspeed.compression.helper``: DeepSpeed 0.19.8's deprecated home of the two helpers DeepSpeed-Chat
imports; they live in ``deepspeed.utils.module_utils``."""
import warnings

from deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn("deepspeed.compression.helper is deprecated; import recursive_getattr and recursive_setattr from "
              "deepspeed.utils.module_utils", FutureWarning, stacklevel=2)

__all__ = ["recursive_getattr", "recursive_setattr"]
