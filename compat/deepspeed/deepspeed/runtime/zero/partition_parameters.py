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
# so these names exist for that code to find and restore (DeepSpeed's module keeps one per constructor it
# swaps: tests rebind `_orig_torch_empty` around an Init); the wrapper keeps DeepSpeed's meaning.
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


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


class MultipleAllGatherHandles:
    """Several all-gather handles waited on as one (DeepSpeed's class of that name): ``wait`` passes its
    keyword on to every handle's ``wait``."""

    def __init__(self, handles) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


__all__ += ["MultipleAllGatherHandles"]

# The shape of a ZeRO-3 parameter's ``.data`` while it is partitioned (released): empty, in shardwise
# (shardwise.zero.partitioned_param) as in DeepSpeed.
partitioned_param_data_shape = [0]
__all__ += ["partitioned_param_data_shape"]


def _contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None):
    """DeepSpeed's check that ``zero.Init``'s group does not contradict the launcher's ``WORLD_SIZE`` (its message,
    or None); ``shardwise.zero.init.single_rank_group_error``, which ``zero.Init`` raises as ``RuntimeError``."""
    from shardwise.zero.init import single_rank_group_error

    return single_rank_group_error(dp_world_size, explicit_process_group, env)
