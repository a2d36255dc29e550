"""Reading DeepSpeed's pickle files without running code from them.

DeepSpeed writes its checkpoints with ``torch.save``: pickles.  Unpickling an untrusted pickle
can call any importable function (``os.system`` ...), so every DeepSpeed file is read with
torch's restricted unpickler (``torch.load(weights_only=True)``: tensors, storages, containers,
numbers, strings, ``torch.Size``, dtypes; no other global) plus exactly the DeepSpeed classes
DeepSpeed 0.1x writes into its files, each mapped to an inert stand-in defined here that only
stores the attributes it is given.  DeepSpeed itself is never imported.  A file naming any other
global is refused with the global's name before that global is looked up, let alone called.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch


class _Inert:
    """A record of the attributes a DeepSpeed object was pickled with; no behaviour."""

    def __init__(self, *args) -> None:
        self.args = args

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScalerState(_Inert):
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``
    (attributes ``cur_scale``, ``dynamic``, and for the dynamic one ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, ...)."""


class ZeroStage(_Inert):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(n)``)."""

    def __init__(self, value=None) -> None:
        self.value = int(value) if value is not None else None

    def __int__(self) -> int:
        return self.value


class FragmentAddress(_Inert):
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


# Exactly the globals (besides torch's own tensor machinery) found in checkpoints written by
# DeepSpeed 0.1x's save_checkpoint at ZeRO 0-3 in fp32/fp16/bf16.
DEEPSPEED_GLOBALS: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}


class RefusedPickle(ValueError):
    """A checkpoint file names a global that is not allowed; nothing from it was executed."""

    def __init__(self, path, name: str, detail: str) -> None:
        super().__init__(f"{path}: refused to unpickle global '{name}': it is not one DeepSpeed writes into a "
                         f"checkpoint, so the file was not loaded and nothing in it was run ({detail})")
        self.path, self.name = path, name


_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)|unrecognized function (\S+)|got (<class '[^']+'>)")


def load_deepspeed_file(path) -> object:
    """``torch.load`` of one DeepSpeed checkpoint file, restricted as the module docstring says."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed checkpoint file missing: {path}")
    allowed = [(cls, name) for name, cls in DEEPSPEED_GLOBALS.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as e:  # torch wraps the unpickler's refusal in a long advisory message
        text = str(e)
        m = _GLOBAL_IN_ERROR.search(text)
        if m is None:
            raise ValueError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: "
                             f"{text.splitlines()[0] if text else ''})") from None
        name = next(g for g in m.groups() if g)
        raise RefusedPickle(path, name, "torch.load(weights_only=True) with DeepSpeed's classes allowlisted") \
            from None


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"
