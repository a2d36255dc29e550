"""``deepspeed.git_version_info``: what DeepSpeed's setup.py records at install time, read from the
running torch and shardwise instead (there are no compiled ops: none is installed or compatible)."""
import torch

import shardwise

version = f"0.19.8+shardwise.{shardwise.__version__}"  # DeepSpeed's API level, then what it is (as __version__)
git_hash = None
git_branch = None
installed_ops: dict[str, bool] = {}  # no op is compiled
compatible_ops: dict[str, bool] = {}  # filled in below from deepspeed.ops.op_builder
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(v) -> str:
    return ".".join(str(v).split(".")[:2]) if v else "0.0"


def _nccl() -> str:
    try:
        return _major_minor(".".join(map(str, torch.cuda.nccl.version()))) if torch.cuda.is_available() else "0.0"
    except (AttributeError, RuntimeError):
        return "0.0"


torch_info = {
    "version": _major_minor(torch.__version__.split("+")[0]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}


def _compatible() -> None:
    from .ops.op_builder import ALL_OPS

    installed_ops.update(dict.fromkeys(ALL_OPS, False))
    compatible_ops.update({name: b.is_compatible() for name, b in ALL_OPS.items()})


_compatible()
