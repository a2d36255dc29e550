"""``deepspeed.inference.quantization.utils``: DeepSpeed's group-wise weight quantization, as
``deepspeed.zero.Init`` applies it to the ``nn.Linear`` / ``nn.Embedding`` weights built inside it when the config
has ``weight_quantization.quantized_initialization`` (ZeRO-Inference's quantized weights), in torch ops.

Quantization is asymmetric, per group: the weight is cut along ``group_dim`` into groups of ``group_size``
elements; each group keeps its minimum ``min`` and ``scale = (2**num_bits - 1) / (max - min)``, and each element
the code ``round((x - min) * scale)`` (``num_bits`` 8: one byte each; 4: two codes a byte, the first in the high
half). A quantized weight parameter holds one flat tensor of its own dtype: the code bytes seen as that dtype,
then the scales, then the minimums (``concat_to_compat_param``); ``param.deconcat(param)`` cuts it back into the
three, ``param.dequantizer.dequantize(codes.view(torch.uint8), scale, min)`` gives ``codes / scale + min``.
``wrap_quantized_functional(F.linear)`` (and ``F.embedding``) dequantizes such a weight for each call, so the whole
weight exists only while a layer runs; under ZeRO-3 the flat tensor is what is partitioned and gathered.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Tuple, Union

import torch
from torch import Tensor, nn

from shardwise.accelerator import get_accelerator  # noqa: F401  (DeepSpeed's module exposes it)

__all__ = ["DeQuantizer", "Quantizer", "WEIGHT_QUANTIZATION_LAYERS", "concat_to_compat_param",
           "get_AsyncPartitionedParameterSwapper", "recursive_setattr", "tensor_clamp", "tensor_round",
           "wrap_load_from_state_dict", "wrap_quantized_functional"]

# the layer types whose ``weight`` zero.Init quantizes (exact types, not subclasses)
WEIGHT_QUANTIZATION_LAYERS = (nn.Linear, nn.Embedding)


def tensor_clamp(tensor: Tensor, min, max) -> Tensor:
    """``tensor.clamp_(min, max)`` (fp16 on the CPU through fp32, which its kernels need)."""
    if tensor.device.type == "cpu" and tensor.dtype == torch.float16:
        return tensor.copy_(tensor.float().clamp_(min, max))
    return tensor.clamp_(min, max)


def tensor_round(tensor: Tensor) -> Tensor:
    """``tensor.round_()`` (fp16 on the CPU through fp32)."""
    if tensor.device.type == "cpu" and tensor.dtype == torch.float16:
        return tensor.copy_(tensor.float().round_())
    return tensor.round_()


def _check_config(config: Dict) -> Dict:
    """The quantization settings, checked: ``num_bits`` 4 or 8, ``group_size`` > 0, ``group_dim``, ``symmetric``
    false (only asymmetric groups are implemented, as in DeepSpeed)."""
    where = "weight_quantization.quantized_initialization"
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a dict, not {type(config).__name__}")
    missing = [k for k in ("num_bits", "group_size", "group_dim", "symmetric") if k not in config]
    if missing:
        raise ValueError(f"{where}: missing {missing} (num_bits, group_size, group_dim and symmetric are required)")
    if config["num_bits"] not in (4, 8):
        raise ValueError(f"{where}.num_bits must be 4 or 8, not {config['num_bits']!r}")
    if not isinstance(config["group_size"], int) or config["group_size"] < 1:
        raise ValueError(f"{where}.group_size must be a positive integer, not {config['group_size']!r}")
    if not isinstance(config["group_dim"], int):
        raise ValueError(f"{where}.group_dim must be an integer, not {config['group_dim']!r}")
    if config["symmetric"] is not False:
        raise ValueError(f"{where}.symmetric: only asymmetric quantization (false) is implemented")
    return config


def _grouped(tensor: Tensor, config: Dict) -> Tuple[Tensor, int]:
    """``tensor`` viewed with ``group_dim`` split into (groups, group_size); the index of the group elements."""
    dim, size = config["group_dim"] % tensor.dim(), config["group_size"]
    if tensor.shape[dim] % size:
        raise ValueError(f"weight_quantization.quantized_initialization: group_size {size} does not divide "
                         f"dimension {dim} ({tensor.shape[dim]}) of a weight of shape {tuple(tensor.shape)}")
    shape = tensor.shape
    return tensor.reshape(shape[:dim] + (shape[dim] // size, size) + shape[dim + 1:]), dim + 1


class Quantizer:
    """``quantize(tensor)`` -> ``(codes, scale, min)``: uint8 codes of ``tensor``'s shape (4 bits: the last dimension
    halved, two codes a byte), and per group its scale and minimum (the group dimension kept, of size 1)."""

    def __init__(self, config: Dict) -> None:
        self.config = _check_config(config)

    def quantize(self, tensor: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        levels = 2**self.config["num_bits"] - 1
        grouped, inner = _grouped(tensor.detach().float(), self.config)
        low = grouped.amin(dim=inner, keepdim=True)
        span = grouped.amax(dim=inner, keepdim=True) - low
        # a constant group (span 0) gets codes 0; the scale stays finite in the weight's dtype
        finite = torch.finfo(tensor.dtype).max if tensor.is_floating_point() else torch.finfo(torch.float32).max
        scale = levels / span.clamp_min(levels / finite)
        codes = ((grouped - low) * scale).clamp_(0, levels).round_().to(torch.uint8).reshape(tensor.shape)
        if self.config["num_bits"] == 4:
            codes = _pack_nibbles(codes)
        return codes, scale.to(tensor.dtype), low.to(tensor.dtype)


class DeQuantizer:
    """``dequantize(codes, scale, min)`` -> the weight in ``dtype``: ``codes / scale + min`` per group."""

    def __init__(self, config: Dict, dtype: torch.dtype) -> None:
        self.config = _check_config(config)
        self.dtype = dtype

    def dequantize(self, tensor: Tensor, quant_scale: Tensor, quant_min: Tensor) -> Tensor:
        if tensor.dtype != torch.uint8:
            raise TypeError(f"DeQuantizer.dequantize takes the uint8 codes, not {tensor.dtype}")
        codes = _unpack_nibbles(tensor) if self.config["num_bits"] == 4 else tensor
        grouped, _ = _grouped(codes, self.config)
        out = grouped.to(torch.float32) / quant_scale.float() + quant_min.float()
        return out.reshape(codes.shape).to(self.dtype)


def _pack_nibbles(codes: Tensor) -> Tensor:
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit weight quantization needs an even last dimension, not {tuple(codes.shape)}")
    return codes[..., 0::2].bitwise_left_shift(4).bitwise_or_(codes[..., 1::2])


def _unpack_nibbles(packed: Tensor) -> Tensor:
    out = torch.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed.bitwise_right_shift(4)
    out[..., 1::2] = packed.bitwise_and(0xF)
    return out


def concat_to_compat_param(quantized_weight: Tensor, quant_scale: Tensor, quant_min: Tensor,
                           return_param: bool = True) -> Union[nn.Parameter, Tensor]:
    """One flat tensor holding the three (all of one dtype: the codes already seen as the weight's dtype), with
    ``deconcat(flat)`` cutting a tensor of that layout back into views of the three shapes; a Parameter without
    gradient unless ``return_param`` is false."""
    shapes = [quantized_weight.shape, quant_scale.shape, quant_min.shape]
    flat = torch.cat([quantized_weight.reshape(-1), quant_scale.reshape(-1), quant_min.reshape(-1)])

    def deconcat(tensor: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        parts, start = [], 0
        for shape in shapes:
            n = shape.numel()
            parts.append(torch.narrow(tensor.reshape(-1), 0, start, n).view(shape))
            start += n
        return tuple(parts)

    if return_param:
        flat = nn.Parameter(flat, requires_grad=False)
    flat.deconcat = deconcat
    return flat


def _as_dtype(codes: Tensor, dtype: torch.dtype) -> Tensor:
    """The uint8 codes seen as ``dtype`` (their bytes, not their values): the last dimension shrinks by the
    element size, which must divide it."""
    size = torch.empty((), dtype=dtype).element_size()
    if codes.shape[-1] % size:
        raise ValueError(f"weight_quantization.quantized_initialization: a weight whose codes have shape "
                         f"{tuple(codes.shape)} cannot be stored as {dtype} (the last dimension must be a multiple "
                         f"of {size} bytes)")
    return codes.view(dtype)


def _quantize_param(param: nn.Parameter, quant_config: Dict) -> None:
    """Replace ``param``'s values by their quantized form (the flat layout of ``concat_to_compat_param``) and give
    it ``deconcat``, ``quantizer``, ``dequantizer`` and ``weight_quantized = True``."""
    if getattr(param, "weight_quantized", False):
        raise ValueError("this parameter is quantized already")
    quantizer = Quantizer(quant_config)
    codes, scale, low = quantizer.quantize(param.data)
    flat = concat_to_compat_param(_as_dtype(codes, param.dtype), scale, low, return_param=False)
    param.data = flat
    param.deconcat = flat.deconcat
    param.quantizer = quantizer
    param.dequantizer = DeQuantizer(quant_config, param.dtype)
    param.weight_quantized = True


def _dequantized(weight: Tensor) -> Tensor:
    codes, scale, low = weight.deconcat(weight.detach())
    return weight.dequantizer.dequantize(codes.view(torch.uint8), scale, low)


def wrap_quantized_functional(f: Callable) -> Callable:
    """``f(input, weight, ...)`` (``F.linear``, ``F.embedding``) called with a quantized weight's dequantized
    values; other weights pass through. ``__wrapped__`` is ``f``."""

    @functools.wraps(f)
    def wrapper(input: Tensor, weight: Tensor, *args, **kwargs) -> Tensor:
        if getattr(weight, "weight_quantized", False):
            weight = _dequantized(weight)
        return f(input, weight, *args, **kwargs)

    wrapper._dequantizes = True
    return wrapper


def wrap_load_from_state_dict(f: Callable) -> Callable:
    """A layer's ``_load_from_state_dict`` that quantizes an incoming whole ``weight`` (with the layer's own
    quantizer) when the layer's weight is quantized, so a full-precision checkpoint loads into it; the caller's
    state dict is left as it was."""

    @functools.wraps(f)
    def wrapper(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        weight = getattr(module, "weight", None)
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if getattr(weight, "weight_quantized", False) and incoming is not None \
                and not getattr(incoming, "weight_quantized", False) and not hasattr(incoming, "deconcat"):
            codes, scale, low = weight.quantizer.quantize(incoming.to(weight.dtype))
            state_dict[key] = concat_to_compat_param(_as_dtype(codes, weight.dtype), scale, low, return_param=False)
            try:
                return f(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs)
            finally:
                state_dict[key] = incoming
        return f(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    wrapper._quantizes_state = True
    return wrapper


def get_AsyncPartitionedParameterSwapper(model: nn.Module):  # noqa: N802 (DeepSpeed's name)
    """The NVMe swapper of the first parameter of ``model`` that has one (``param.nvme_swapper``), else None."""
    for _, param in model.named_parameters():
        if getattr(param, "nvme_swapper", None) is not None:
            return param.nvme_swapper
    return None


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """``model.<a>.<b>.<c> = module`` for ``module_name`` ``"a.b.c"``."""
    *path, last = module_name.split(".")
    owner = model
    for name in path:
        owner = getattr(owner, name)
    setattr(owner, last, module)
