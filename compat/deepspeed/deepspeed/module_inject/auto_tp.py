"""``deepspeed.module_inject.auto_tp``: ``AutoTP`` with DeepSpeed's constructor, over shardwise's AutoTP
(``shardwise.tensor_parallel.autotp``).

With a ``partition_config`` (``deepspeed.module_inject.autotp_config.AutoTPConfig``) the model is walked as
DeepSpeed walks it: every child with a 2-D ``weight`` is looked up by its full path (``layers.0.self_attn.
q_proj`` + ``.weight``) in the config's specs and becomes DeepSpeed's ``LinearLayer`` / ``LinearAllreduce``
(``SubParamLinearLayer`` / ``SubParamLinearAllreduce`` with a ``shape``) of ``deepspeed.module_inject.layers``,
or stays whole (SKIP, no match); unmatched children are walked into. Without one, shardwise's recognition
by projection names (and the model's Hugging Face ``tp_plan``) shards the model.

Not provided: loading weights from a ``state_dict`` while replacing, custom ``linear_layer_setting``
policies, the vocabulary-parallel LM head, and slicing embeddings by a spec (each raises a named error).
"""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from shardwise import comm
from shardwise.tensor_parallel.autotp import AutoTP as _ShardwiseAutoTP
from shardwise.tensor_parallel.autotp import _Block

from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec
from .layers import LinearAllreduce, LinearLayer, SubParamLinearAllreduce, SubParamLinearLayer

__all__ = ["AutoTP", "AutoTPConfig", "PartitionType", "TPLayerSpec"]


def _refused(what: str) -> NotImplementedError:
    return NotImplementedError(f"deepspeed.module_inject.auto_tp.AutoTP: {what} is not supported by shardwise. "
                               "See docs/deepspeed-compat.md")


class AutoTP(_ShardwiseAutoTP):
    """DeepSpeed's ``AutoTP(module, all_reduce_linears, prefix, state_dict, linear_layer_setting,
    orig_layer_impl, ..., partition_config=None, ...)``; ``set_tensor_parallel_config(mp_size, mp_group)``
    then ``_replace_module(module)`` shards it."""

    def __init__(self, module, all_reduce_linears=None, prefix="", state_dict=None, linear_layer_setting=None,
                 orig_layer_impl=None, keep_module_on_host: bool = False,
                 partition_config: Optional[AutoTPConfig] = None, vocab_parallel_lm_head: bool = False,
                 model_config=None, tp_grain_size: int = 1, training_mode: bool = False):
        if vocab_parallel_lm_head:
            raise _refused("vocab_parallel_lm_head=True (the vocabulary-parallel LM head)")
        self.module = module
        self.all_reduce_linears = list(all_reduce_linears or [])
        self.prefix = prefix
        self.state_dict = state_dict
        self.linear_layer_setting = linear_layer_setting
        self.orig_layer_impl = orig_layer_impl
        self.keep_module_on_host = keep_module_on_host
        self.partition_config = partition_config
        self.vocab_parallel_lm_head = vocab_parallel_lm_head
        self.model_config = model_config
        self.tp_grain_size = tp_grain_size
        self.training_mode = training_mode
        self.linear_policies = None
        self.conv_linear_layer = False
        self.mp_group = None
        self.mp_size = 1
        self.tp_rank = 0

    # -- DeepSpeed's set-up calls ----------------------------------------------------------------
    def set_tensor_parallel_config(self, mp_size, mp_group) -> None:
        self.mp_group = mp_group
        self.mp_size = int(mp_size or 1) if mp_group is None else comm.get_world_size(mp_group)
        self.tp_rank = 0 if mp_group is None else comm.get_rank(mp_group)

    def update_linear_policies(self) -> None:
        if self.linear_layer_setting is not None:
            raise _refused("a custom linear_layer_setting (DeepSpeed's replacement policies)")
        self.linear_policies = {nn.Linear: self._replace_with_config}

    def _get_model_type(self) -> Optional[str]:
        """``config.model_type`` of the model, else guessed from its class name (``LlamaDecoderLayer`` -> llama)."""
        model_type = getattr(getattr(self.module, "config", None), "model_type", None)
        if model_type:
            return str(model_type).lower()
        name = type(self.module).__name__
        for pattern in (r"(\w+)DecoderLayer", r"(\w+)Block", r"(\w+)Layer"):
            match = re.match(pattern, name)
            if match:
                return match.group(1).lower()
        return None

    # -- replacement -----------------------------------------------------------------------------
    def _replace_module(self, r_module, prev_name: str = "", prev_class_name: str = ""):
        if self.state_dict is not None:
            raise _refused("loading weights from a state_dict while replacing layers")
        if self.partition_config is None:
            return self._replace_by_recognition(r_module)
        block = _Block(prev_name, r_module)
        for name, child in r_module.named_children():
            if getattr(child, "_is_autoep_layer", False):  # routed experts are expert-parallel, not split here
                self._replace_autoep_shared_experts(child, f"{prev_name}.{name}" if prev_name else name)
                continue
            if prev_class_name == "":
                class_name = prev_name
            elif prev_name == "":
                class_name = prev_class_name
            else:
                class_name = f"{prev_class_name}.{prev_name}"
            full_name = f"{class_name}.{name}" if class_name else name
            if isinstance(child, nn.Embedding):
                spec = self.partition_config.find_matching_spec(full_name + ".weight", self._get_model_type())
                if spec is not None and spec.partition_type != PartitionType.SKIP:
                    raise _refused(f"slicing the embedding {full_name!r} by a partition spec")
            elif isinstance(getattr(child, "weight", None), nn.Parameter) and child.weight.dim() == 2:
                new_child = self._replace_with_config(child, full_name)
                if new_child is not None and new_child is not child:
                    setattr(r_module, name, new_child)
                    (block.row if isinstance(new_child, LinearAllreduce) else block.column).append(name)
            else:
                self._replace_module(child, name, class_name)
        if block.row and block.column and self.mp_size > 1:
            self._shrink_heads(r_module)
        return r_module

    def _replace_by_recognition(self, r_module):
        """Without a ``partition_config``: shardwise's recognition by projection names / ``tp_plan`` over the
        model, except inside AutoEP layers, whose shared experts go through ``_replace_autoep_shared_experts``
        and whose routed experts stay as they are (expert-parallel). Returns the model, as DeepSpeed's does."""
        autoep = []
        for name, module in r_module.named_modules():
            if getattr(module, "_is_autoep_layer", False) and not any(name.startswith(p + ".") for p, _ in autoep):
                autoep.append((name, module))
        for name, module in autoep:
            self._replace_autoep_shared_experts(module, name)
        if not autoep:
            super()._replace_module(r_module)
            return r_module
        # the rest of the model, with the AutoEP layers out of sight of the recognition
        hidden = []
        for name, module in autoep:
            parent_name, _, attr = name.rpartition(".")
            if not name:  # the model itself is one AutoEP layer
                return r_module
            parent = r_module.get_submodule(parent_name)
            hidden.append((parent, attr, module))
            parent._modules[attr] = nn.Module()
        try:
            _ShardwiseAutoTP._replace_module(self, r_module)
        except ValueError as e:
            if "found no attention/MLP projections" not in str(e):
                raise
        finally:
            for parent, attr, module in hidden:
                parent._modules[attr] = module
        return r_module

    def _replace_autoep_shared_experts(self, autoep_layer, autoep_name):
        """An AutoEP layer's ``shared_experts`` / ``shared_experts_gate``: matched against the
        ``partition_config`` like any layer (a 2-D weight) or walked into; without a config, a shared-expert
        MLP is split by shardwise's recognition and a gate stays whole."""
        for child_name in ("shared_experts", "shared_experts_gate"):
            child = getattr(autoep_layer, child_name, None)
            if child is None:
                continue
            full_name = f"{autoep_name}.{child_name}" if autoep_name else child_name
            if self.partition_config is not None:
                weight = getattr(child, "weight", None)
                if isinstance(weight, nn.Parameter) and weight.dim() == 2:
                    new_child = self._replace_with_config(child, full_name)
                    if new_child is not None:
                        setattr(autoep_layer, child_name, new_child)
                else:
                    self._replace_module(child, full_name, "")
            elif not isinstance(child, nn.Linear):
                try:
                    _ShardwiseAutoTP._replace_module(self, child, name_prefix=full_name)
                except ValueError as e:  # nothing recognisable: kept whole
                    if "found no attention/MLP projections" not in str(e):
                        raise

    def _shrink_heads(self, module: nn.Module) -> None:
        """The per-rank counts of a module whose projections were split (``num_heads``, ``hidden_size``, ...)."""
        from shardwise.tensor_parallel.autotp import _PER_RANK_ATTRS

        for attr in _PER_RANK_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % self.mp_size:
                    raise ValueError(f"AutoTP: {type(module).__name__}.{attr} = {value} is not divisible by the "
                                     f"tensor-parallel size {self.mp_size}")
                setattr(module, attr, value // self.mp_size)

    def _replace_with_config(self, child, name):
        """The layer ``child`` (at path ``name``) becomes under the first matching spec; ``child`` itself when
        none matches (an error in ``strict_mode``) or the spec is SKIP."""
        if getattr(child, "replaced", False):
            return child
        param_name = name if name.endswith(".weight") else name + ".weight"
        spec = self.partition_config.find_matching_spec(param_name, self._get_model_type())
        if spec is None:
            if self.partition_config.strict_mode:
                raise ValueError(f"No matching spec for {param_name}")
            return child
        setattr(child, "replaced", True)
        if spec.partition_type == PartitionType.SKIP:
            if spec.grad_allreduce and self.mp_size > 1:
                from shardwise.param_attrs import mark_autotp_grad_allreduce
                from shardwise.tensor_parallel.autotp import _sum_over_group

                for p in child.parameters():
                    if p.requires_grad:
                        p.register_hook(_sum_over_group(self.mp_group))
                        mark_autotp_grad_allreduce(p)
            return child
        if spec.partition_type == PartitionType.ROW:
            if spec.shape is not None:
                return SubParamLinearAllreduce(child, self.mp_group, shape=spec.shape,
                                               partition_dim=spec.get_partition_dim(), name=name)
            return LinearAllreduce(child, self.mp_group, name=name)
        if spec.shape is not None:
            return SubParamLinearLayer(child, self.mp_group, shape=spec.shape, partition_dim=spec.get_partition_dim(),
                                       name=name)
        return LinearLayer(child, self.mp_group, gather_output=spec.gather_output, name=name)
