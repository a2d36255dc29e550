"""LoRA adapters applied per row over one copy of a base model (several adapters, one server).

Each adapter is a peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``, as
``shardwise finetune --lora_r ...`` and peft's ``save_pretrained`` write it). Its low-rank factors
are read once; the base model's weights are never changed. A forward hook on every targeted
``nn.Linear`` adds, for the tokens whose request chose adapter ``a``,

    y = base(x) + scale_a * B_a(A_a(x))        (scale_a = lora_alpha / r, or / sqrt(r) with rslora)

so requests for different adapters and for the base model run in the same forward pass. Which
adapter each token uses is set around a forward pass with :meth:`LoraAdapters.use`; outside it
the hooks do nothing (the base model behaves as loaded).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading

import torch

__all__ = ["LoraAdapters", "BASE"]

BASE = 0  # the adapter index of "no adapter"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


def _read_config(name: str, path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"adapter {name!r}: {path} is not a folder")
    if not os.path.isfile(config_file):
        raise ValueError(f"adapter {name!r}: {path} has no adapter_config.json (not a peft LoRA adapter folder)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except ValueError as exc:
        raise ValueError(f"adapter {name!r}: {config_file} is not valid JSON ({exc})") from None
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"adapter {name!r}: {config_file} is a {kind} adapter; only LoRA adapters are served "
                         "per request")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D targets)")):
        if config.get(key):
            raise ValueError(f"adapter {name!r}: {config_file} uses {why}, which per-request serving does not "
                             "support; merge it into the model instead (shardwise finetune --merge_lora)")
    if config.get("modules_to_save"):
        raise ValueError(f"adapter {name!r}: {config_file} also saves whole modules ({config['modules_to_save']}), "
                         "which cannot be applied per request; merge it into the model instead")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: {config_file} trains biases (bias={config['bias']!r}); "
                         "only bias='none' adapters are served per request")
    return config


def _read_weights(name: str, path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"adapter {name!r}: {path} has no adapter_model.safetensors or adapter_model.bin")


def _pattern_value(patterns: dict, module: str, default):
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


class LoraAdapters:
    """Named LoRA adapters over ``model``; index 0 (:data:`BASE`) is the base model itself."""

    def __init__(self, model: torch.nn.Module, adapters: dict[str, str]) -> None:
        self.names: list[str] = []
        self._local = threading.local()
        # module name -> {adapter index: (A [r, in], B [out, r], scale)}
        self._factors: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._hooks = []
        params = next(model.parameters())
        for name, path in adapters.items():
            if not name or name in self.names:
                raise ValueError(f"adapter names must be unique and not empty, got {name!r}")
            self.names.append(name)
            self._load(model, len(self.names), name, path, params.dtype, params.device)
        modules = dict(model.named_modules())
        for module_name in self._factors:
            self._hooks.append(modules[module_name].register_forward_hook(self._hook(module_name)))

    def _load(self, model, index: int, name: str, path: str, dtype, device) -> None:
        config = _read_config(name, path)
        weights = _read_weights(name, path)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            match = _KEY.match(key)
            if match is None:
                raise ValueError(f"adapter {name!r}: {path} holds {key!r}, which is not a LoRA A/B weight of a "
                                 "Linear layer (embedding LoRA, DoRA and saved modules are not served per request)")
            pairs.setdefault(match["module"], {})[match["which"]] = tensor
        if not pairs:
            raise ValueError(f"adapter {name!r}: {path} holds no LoRA weights")
        for module_name, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"adapter {name!r}: {path} has lora_A without lora_B (or the reverse) for "
                                 f"{module_name}")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise ValueError(f"adapter {name!r}: {path} adapts {module_name}, which the base model does not "
                                 "have (was it trained on another model?)") from None
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"adapter {name!r}: {module_name} is a {type(module).__name__}; only Linear layers "
                                 "are adapted per request")
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if a.shape != (r, module.in_features) or b.shape != (module.out_features, r):
                raise ValueError(f"adapter {name!r}: {module_name} has LoRA factors {tuple(a.shape)} and "
                                 f"{tuple(b.shape)}, which do not fit the base layer ({module.in_features} in, "
                                 f"{module.out_features} out): the adapter was trained on another model")
            alpha = _pattern_value(config.get("alpha_pattern"), module_name, config.get("lora_alpha", 8))
            scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
            self._factors.setdefault(module_name, {})[index] = (a.to(device, dtype), b.to(device, dtype), float(scale))

    def index(self, name: str | None) -> int:
        """The index of adapter ``name`` (None: the base model); ValueError naming the known ones."""
        if name is None:
            return BASE
        try:
            return self.names.index(name) + 1
        except ValueError:
            known = ", ".join(self.names) or "none"
            raise ValueError(f"unknown adapter {name!r} (loaded: {known})") from None

    @contextlib.contextmanager
    def use(self, token_adapters: torch.Tensor | None):
        """Within the block, token ``i`` of the forward pass uses adapter ``token_adapters[i]``;
        the tensor broadcasts against the input's leading dimensions ((batch, 1) for a row each)."""
        if token_adapters is not None and not bool((token_adapters != BASE).any()):
            token_adapters = None
        self._local.active = token_adapters
        try:
            yield
        finally:
            self._local.active = None

    def _hook(self, module_name: str):
        factors = self._factors[module_name]

        def hook(module, inputs, output):
            which = getattr(self._local, "active", None)
            if which is None:
                return None
            x = inputs[0]
            flat_x = x.reshape(-1, x.shape[-1])
            flat_which = which.expand(x.shape[:-1]).reshape(-1)
            flat_out = output.reshape(-1, output.shape[-1])
            for index in flat_which.unique().tolist():
                if index not in factors:
                    continue
                a, b, scale = factors[index]
                rows = (flat_which == index).nonzero().squeeze(1)
                delta = torch.nn.functional.linear(torch.nn.functional.linear(flat_x.index_select(0, rows), a), b)
                flat_out.index_add_(0, rows, delta * scale)
            return flat_out.view(output.shape)

        return hook

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
