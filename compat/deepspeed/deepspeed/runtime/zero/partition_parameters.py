"""``deepspeed.runtime.zero.partition_parameters``."""

from shardwise.zero.init import GatheredParameters, Init, register_external_parameter
from shardwise.zero.partitioned_param import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]

import functools  # noqa: E402

import torch  # noqa: E402

from shardwise.accelerator import get_accelerator  # noqa: E402,F401  (DeepSpeed's module exposes it)

# DeepSpeed's zero.Init swaps torch's tensor constructors for versions that build floating tensors in
# the training dtype on the device; Hugging Face's `prevent_arange_dtype_change` replaces the wrapper
# below around `zero.Init` and compares against `_orig_torch_arange`. shardwise's Init does not swap
# constructors (parameters are sharded as each module finishes its __init__ and cast by the engine),
# so these two names exist for that code to find and restore; the wrapper keeps DeepSpeed's meaning.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype, target_device=None):
    """``fn`` (a tensor constructor) whose floating results are cast to ``target_fp_dtype`` and built on
    ``target_device`` when no device is given (DeepSpeed's helper of the same name)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__all__ += ["zero_wrapper_for_fp_tensor_constructor"]
