"""Random layer-wise token dropping (random-LTD), in plain PyTorch.

A wrapped layer (``TokenDropLayer``) runs on a random, order-preserving subset of the sequence's
tokens; the tokens it skipped pass through unchanged. How many tokens are kept grows with training
(``TokenDropSchedule``, DeepSpeed's ``fixed_linear`` schedule: from ``min_value`` to ``max_value``
over ``require_steps``, in multiples of ``seq_per_step``). All wrapped layers of one forward pass use
the token subsets the first of them (``random_ltd_layer_id`` 0) drew, one per layer.

Gradients: kept tokens get the layer's gradient, skipped tokens the identity's (the wrapped layer is
``out = h; out[kept] = layer(h[kept])``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["TokenDropLayer", "TokenDropSchedule", "sample_tokens_decoder", "sample_tokens_encoder",
           "gather_tokens", "scatter_tokens", "wrap_layers", "attach_schedule", "strip_token_drop_keys"]



def _draw(reserved_length: int, seq_length: int, batch_size: int, layers: int, device) -> torch.Tensor:
    weights = torch.ones((layers * batch_size, seq_length), device=device)
    picked = torch.multinomial(weights, reserved_length)  # without replacement, uniformly
    return picked.sort(dim=-1).values.reshape(layers, batch_size, reserved_length)


def sample_tokens_decoder(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device="cpu",
                          attn_mask: torch.Tensor | None = None):
    """Sorted token indices ``[layers, batch, reserved_length]`` and the causal mask cut to
    ``[..., :reserved_length, :reserved_length]`` (a causal mask stays causal on any ordered subset)."""
    indices = _draw(reserved_length, seq_length, batch_size, layers, device)
    mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, mask


def sample_tokens_encoder(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device="cpu",
                          attn_mask: torch.Tensor | None = None):
    """Sorted token indices ``[layers, batch, reserved_length]`` and, per layer, the attention mask
    ``[batch, 1, reserved, reserved]`` restricted to each sample's kept tokens (rows and columns)."""
    if attn_mask is None:
        raise ValueError("random-LTD for encoders needs the attention mask (model_mask_name)")
    indices = _draw(reserved_length, seq_length, batch_size, layers, device)
    masks = []
    for layer in range(layers):
        rows = [attn_mask[b:b + 1][:, :, indices[layer, b]][..., indices[layer, b]] for b in range(batch_size)]
        masks.append(torch.cat(rows, dim=0))
    return indices, masks


def _expand(indices: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``indices`` [batch, kept] as an index for ``torch.gather``/``scatter`` along the sequence dim."""
    idx = indices.long()
    if batch_first:  # [batch, seq, hidden]
        return idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return idx.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # [seq, batch, hidden]


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool):
    """``(hidden, hidden's tokens at indices)``: ``indices`` is [batch, kept], sorted."""
    return hidden, torch.gather(hidden, 1 if batch_first else 0, _expand(indices, hidden, batch_first))


def scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor, batch_first: bool):
    """A copy of ``hidden`` with the tokens at ``indices`` replaced by ``part``."""
    return hidden.scatter(1 if batch_first else 0, _expand(indices, hidden, batch_first), part)


class TokenDropSchedule:
    """How many tokens random-LTD layers keep at each step (DeepSpeed's ``RandomLTDScheduler``).

    ``config``: ``total_layer_num``, ``random_ltd_layer_num``, ``global_batch_size`` and
    ``random_ltd_schedule`` = ``{min_value, max_value, schedule_type: "fixed_linear",
    schedule_config: {require_steps, seq_per_step}}``; optional ``layer_token_lr_schedule`` (only
    ``enabled: false``). ``state["consumed_layer_tokens"]`` counts layer-tokens trained on."""

    def __init__(self, config: dict[str, Any]) -> None:
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_schedule", "global_batch_size"):
            if key not in config:
                raise ValueError(f"random_ltd: the schedule needs '{key}'")
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        if (config.get("layer_token_lr_schedule") or {}).get("enabled"):
            raise ValueError("random_ltd.layer_token_lr_schedule: not supported (DeepSpeed does not implement it "
                             "either)")
        if self.config_schedule is not None:
            kind = self.config_schedule.get("schedule_type")
            if kind != "fixed_linear":
                raise ValueError(f"random_ltd.random_ltd_schedule.schedule_type: {kind!r}; only 'fixed_linear' exists")
            for key in ("require_steps", "seq_per_step"):
                if key not in self.config_schedule.get("schedule_config", {}):
                    raise ValueError(f"random_ltd.random_ltd_schedule.schedule_config needs '{key}'")
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        if self.config_schedule is not None:
            self.state["min_value"] = self.config_schedule["min_value"]
            self.state["max_value"] = self.config_schedule["max_value"]
            self.state["current_value"] = self.config_schedule["min_value"]
            self.state["schedule_config"] = self.config_schedule["schedule_config"]
            self.state["schedule_type"] = self.config_schedule["schedule_type"]
        self.state["consumed_layer_tokens"] = 0
        self.state["current_steps"] = -1

    def get_value(self, global_steps: int) -> int:
        s = self.state["schedule_config"]
        lo, hi = self.state["min_value"], self.state["max_value"]
        value = math.floor(float(global_steps) / s["require_steps"] * (hi - lo) + lo)
        value -= value % s["seq_per_step"]
        return min(value, hi)

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            kept = self.state["current_value"] * self.random_ltd_layer_num
            full = self.state["max_value"] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state["consumed_layer_tokens"] += self.global_batch_size * (kept + full)
            self.state["current_steps"] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    _SAVED = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")

    def state_dict(self) -> dict[str, Any]:
        return {k: self.state[k] for k in self._SAVED}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k in self._SAVED:
            self.state[k] = state_dict[k]


class TokenDropLayer(nn.Module):
    """Wraps ``layer`` (its state-dict keys gain ``random_ltd_layer.``). Until ``init_config`` attaches a
    schedule, or in eval mode, or when the schedule keeps the whole sequence, it is ``layer`` itself."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: TokenDropSchedule | None = None
        self.max_length = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.batch_first = False

    def init_config(self, config: dict[str, Any], scheduler: TokenDropSchedule, random_ltd_layer_id: int) -> None:
        """``config`` keys: ``model_mask_name`` (the keyword the mask comes in, or None), ``model_type``
        (``encoder``/``decoder``), ``hidden_state_order`` (``batch_seq_dim``/``seq_batch_dim``),
        ``micro_batch_size``."""
        order, kind = config.get("hidden_state_order"), config.get("model_type")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"random_ltd.hidden_state_order: {order!r}; use 'batch_seq_dim' or 'seq_batch_dim'")
        if kind not in ("encoder", "decoder"):
            raise ValueError(f"random_ltd.model_type: {kind!r}; use 'encoder' or 'decoder'")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state["max_value"]
        self.mask_name = config.get("model_mask_name")
        self.micro_bs = config.get("micro_batch_size")
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first = order == "batch_seq_dim"
        self.model_type = kind
        self.index_generator = sample_tokens_encoder if kind == "encoder" else sample_tokens_decoder

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        schedule = self.random_ltd_scheduler
        if schedule is None:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = schedule.get_current_seq()
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, self.curr_micro_batch = hidden_states.shape[seq_dim], hidden_states.shape[batch_dim]
        if not self.training or self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, **kwargs)
        mask = kwargs[self.mask_name] if self.mask_name is not None else None
        if self.random_ltd_layer_id == 0:
            indices, part_mask = self.index_generator(self.reserved_length, self.curr_seq, self.curr_micro_batch,
                                                      self.random_ltd_num_layer, hidden_states.device, mask)
            schedule.state["sample_idx"], schedule.state["attention_mask"] = indices, part_mask
        else:
            indices, part_mask = schedule.state["sample_idx"], schedule.state["attention_mask"]
        mine = indices[self.random_ltd_layer_id]
        hidden_states, part = gather_tokens(hidden_states, mine, self.batch_first)
        if self.mask_name is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(part, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, mine, self.batch_first)
        if isinstance(outputs, tuple):
            return (scatter_tokens(hidden_states, outputs[0], mine, self.batch_first),) + tuple(outputs[1:])
        raise TypeError(f"random-LTD: the wrapped layer returned {type(outputs).__name__}; it must return a tensor "
                        "or a tuple whose first item is the hidden states")


def wrap_layers(model: nn.Module, layer_type) -> nn.Module:
    """Replace every submodule of type ``layer_type`` by ``TokenDropLayer(submodule)``, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, layer_type) and name:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, TokenDropLayer(module))
    return model


def attach_schedule(model: nn.Module, config: dict[str, Any], schedule: TokenDropSchedule) -> int:
    """Give the ``TokenDropLayer``s whose name contains one of ``config['random_ltd_layer_id']`` the schedule,
    numbering them 0, 1, ... in that order (DeepSpeed's engine does this). Returns how many got one;
    ``config['random_ltd_layer_num']`` must equal it."""
    queue = sorted(config["random_ltd_layer_id"])
    count = 0
    for name, layer in model.named_modules():
        if isinstance(layer, TokenDropLayer) and queue and str(queue[0]) in name:
            layer.init_config(config, schedule, count)
            queue.pop(0)
            count += 1
    if config["random_ltd_layer_num"] != count:
        raise ValueError(f"random_ltd.random_ltd_layer_num is {config['random_ltd_layer_num']} but {count} wrapped "
                         f"layers match random_ltd_layer_id {config['random_ltd_layer_id']}")
    return count


def strip_token_drop_keys(state_dict) -> OrderedDict:
    """``state_dict`` with the ``.random_ltd_layer`` wrapper level removed from its keys (loadable into the
    unwrapped model)."""
    return OrderedDict(((k.replace(".random_ltd_layer", "") if ".random_ltd_layer" in k else k), v)
                       for k, v in state_dict.items())
