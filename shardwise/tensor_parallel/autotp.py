"""AutoTP: shard a Hugging Face causal LM over a tensor-parallel group by module role.

Inside each transformer block the projections are recognised by name, as DeepSpeed's AutoTP does:

* column-parallel (``LinearLayer``): ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``
  (Llama, Qwen2/3, Mistral), ``c_fc`` (GPT-2) and GPT-2's fused ``c_attn``, whose q, k and v blocks
  are split separately (``partition_stride=3``);
* row-parallel (``LinearAllreduce``, output all-reduced): ``o_proj``, ``down_proj``, ``c_proj``.

Embeddings and norms stay replicated. A block is sharded only when both its column and its row
projections are recognised; anything else stays replicated (always correct, not faster). A model none
of whose projections these names match is sharded by its Hugging Face ``tp_plan``
(``config.base_model_tp_plan``, ``_tp_plan``) when it has one: ``colwise`` / ``rowwise``. In either
case a linear the plan marks ``colwise_gather_output`` (``colwise_rep``), such as the LM head of
Hugging Face's causal LMs, is split by its outputs and its output all-gathered (``gather_output``),
unless its weight is tied to another module's or its outputs do not divide by the tensor size (then it
stays whole): the logits are whole on every rank either way, so the loss and ``generate`` are the
ones of the unsharded model.
Attention head counts (``num_attention_heads``, ``num_key_value_heads``) must divide by the
tensor size; attributes of the attention modules that count heads or features per rank
(``num_heads``, ``split_size``, ...) are divided so Hugging Face's forward runs on the shard, while
``model.config`` keeps describing the whole model (``save_pretrained`` writes the real config).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise import comm
from shardwise.param_attrs import autotp_grad_allreduce, mark_autotp_grad_allreduce
from shardwise.tensor_parallel.autotp_layers import LinearAllreduce, LinearLayer, is_conv1d
from shardwise.utils.logging import log_dist

__all__ = ["AutoTP", "autotp_hook", "shard_model", "check_head_counts", "hf_tp_plan", "gathered_columns",
           "COLUMN_PARALLEL", "ROW_PARALLEL", "FUSED_QKV"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_fc")
ROW_PARALLEL = ("o_proj", "down_proj", "c_proj")
FUSED_QKV = {"c_attn": 3}  # GPT-2: [q | k | v] in one Conv1D
# fused projections of other families that need a layout-specific split shardwise does not have
UNSUPPORTED_FUSED = ("qkv_proj", "gate_up_proj", "query_key_value", "W_pack", "Wqkv", "wqkv")
# per-rank counts on attention modules (old HF classes and GPT-2) that must shrink with the shard
_PER_RANK_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "split_size",
                   "hidden_size", "all_head_size", "embed_dim")
_ATTENTION_MARKERS = ("q_proj", "c_attn")


@dataclass
class _Block:
    """One module whose recognised children get sharded."""

    name: str
    module: nn.Module
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)

    @property
    def is_attention(self) -> bool:
        return any(c in _ATTENTION_MARKERS for c in self.column)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def check_head_counts(model: nn.Module, tp_size: int) -> None:
    """Refuse a tensor size that does not divide the model's attention / key-value heads."""
    config = _text_config(model)
    if config is None:
        return
    kind = type(config).__name__
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    problems = []
    if heads is not None and heads % tp_size:
        problems.append(f"num_attention_heads = {heads}")
    if kv_heads is not None and kv_heads % tp_size:
        problems.append(f"num_key_value_heads = {kv_heads}")
    if problems:
        raise ValueError(f"AutoTP cannot shard {type(model).__name__} over {tp_size} tensor-parallel ranks: its "
                         f"{kind} has {' and '.join(problems)}, which must be divisible by the tensor-parallel size "
                         f"(tensor_parallel.autotp_size / tp_size = {tp_size})")


class AutoTP:
    """Find and replace the projections of ``module`` (DeepSpeed's class of the same name, reduced to
    the Hugging Face families listed in the module docstring)."""

    def __init__(self, module: nn.Module, mp_group=None, *, tp_size: int | None = None,
                 tp_rank: int | None = None) -> None:
        self.module = module
        self.mp_group = mp_group
        self.mp_size = tp_size if tp_size is not None else comm.get_world_size(mp_group)
        self.tp_rank = tp_rank if tp_rank is not None else comm.get_rank(mp_group)

    @staticmethod
    def tp_parser(model: nn.Module) -> list[_Block]:
        """The blocks to shard: modules with a recognised row-parallel child and column-parallel siblings."""
        blocks = []
        for name, parent in model.named_modules():
            linears = {n: c for n, c in parent.named_children() if _is_linear(c)}
            row = [n for n in linears if n in ROW_PARALLEL]
            column = [n for n in linears if n in COLUMN_PARALLEL or n in FUSED_QKV]
            fused = [n for n in linears if n in UNSUPPORTED_FUSED]
            if fused and row:
                raise NotImplementedError(
                    f"AutoTP: '{name}.{fused[0]}' ({type(parent).__name__}) is a fused projection shardwise cannot "
                    f"split yet (known: {', '.join(FUSED_QKV)}); use a model with separate projections")
            if row and column:
                blocks.append(_Block(name, parent, column, row))
        if not blocks:
            blocks = _plan_blocks(model, hf_tp_plan(model))
        if not blocks:
            raise ValueError(f"AutoTP found no attention/MLP projections to shard in {type(model).__name__}: it knows "
                             f"column-parallel {', '.join(COLUMN_PARALLEL + tuple(FUSED_QKV))} and row-parallel "
                             f"{', '.join(ROW_PARALLEL)} (Llama, Qwen, Mistral, GPT-2 families)")
        return blocks

    def _replace_module(self, model: nn.Module, name_prefix: str = "") -> list[_Block]:
        """Shard the recognised blocks of ``model``, then the linears its tp_plan gathers (``gathered_columns``);
        ``name_prefix``: ``model``'s path in a larger model (the layers' ``name``, which checkpoints record, is
        the full path)."""
        blocks = self.tp_parser(model)
        kw = dict(tp_size=self.mp_size, tp_rank=self.tp_rank)
        taken = {f"{b.name}.{c}" if b.name else c for b in blocks for c in b.column + b.row}
        for name in gathered_columns(model, hf_tp_plan(model), self.mp_size, taken):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            path = ".".join(p for p in (name_prefix, name) if p)
            setattr(parent, child, LinearLayer(getattr(parent, child), self.mp_group, name=path, gather_output=True,
                                               **kw))
        for block in blocks:
            path = ".".join(p for p in (name_prefix, block.name) if p)
            prefix = f"{path}." if path else ""
            for child in block.column:
                setattr(block.module, child, LinearLayer(getattr(block.module, child), self.mp_group,
                                                         name=prefix + child, fused_parts=FUSED_QKV.get(child, 1),
                                                         **kw))
            for child in block.row:
                setattr(block.module, child, LinearAllreduce(getattr(block.module, child), self.mp_group,
                                                             name=prefix + child, **kw))
            if block.is_attention:
                self._shrink_attention(block)
        return blocks

    def _shrink_attention(self, block: _Block) -> None:
        """Per-rank head counts on the attention module; replicated weights applied per head (Qwen3's
        q_norm / k_norm) get their gradient summed over the tensor group, since each rank sees only its heads."""
        attn = block.module
        for attr in _PER_RANK_ATTRS:
            value = attn.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % self.mp_size:
                    raise ValueError(f"AutoTP: {type(attn).__name__}.{attr} = {value} at '{block.name}' is not "
                                     f"divisible by the tensor-parallel size {self.mp_size}")
                setattr(attn, attr, value // self.mp_size)
        own = [n for n, _ in attn.named_parameters(recurse=False)]
        if own:
            raise NotImplementedError(f"AutoTP: '{block.name}' ({type(attn).__name__}) has its own parameters "
                                      f"{own} (per-head weights such as attention sinks), which shardwise cannot split")
        sharded = set(block.column) | set(block.row)
        for child_name, child in attn.named_children():
            if child_name in sharded:
                continue
            for p in child.parameters():
                if p.requires_grad and not autotp_grad_allreduce(p):
                    p.register_hook(_sum_over_group(self.mp_group))
                    mark_autotp_grad_allreduce(p)


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The Hugging Face tensor-parallel plan of ``model``: ``config.base_model_tp_plan``, then the class's and
    the instance's ``_tp_plan`` (a ``model.``-prefixed pattern already given without the prefix is skipped)."""
    config = getattr(model, "config", None)
    merged, seen = {}, set()
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 vars(model).get("_tp_plan")):
        for pattern, style in (plan or {}).items() if isinstance(plan, dict) else ():
            bare = pattern.removeprefix("model.")
            if pattern.startswith("model.") and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None


_PLAN_KEPT_WHOLE = ("colwise_gather_output", "colwise_rep", "gather", "replicate", "replicated")


def _plan_blocks(model: nn.Module, plan: dict[str, str] | None) -> list[_Block]:
    """Blocks from a Hugging Face tp_plan, for models whose projections the name rules above do not know:
    ``colwise`` / ``rowwise`` linears are split (a parent holding both, as the name rules require); styles
    that gather the output are ``gathered_columns``' (split by outputs where possible), ``gather`` and the
    replicated ones keep the layer whole; any other style is refused."""
    if not plan:
        return []
    rules = [(re.compile(re.escape(p.removeprefix("model.")).replace(r"\*", r"[^.]+") + "$"), p, style)
             for p, style in plan.items()]
    found: dict[str, _Block] = {}
    for name, module in model.named_modules():
        hit = next(((p, style) for rx, p, style in rules if name and rx.fullmatch(name.removeprefix("model."))), None)
        if hit is None or not _is_linear(module):
            continue
        pattern, style = hit
        if style in _PLAN_KEPT_WHOLE:
            continue
        if style not in ("colwise", "rowwise"):
            raise NotImplementedError(f"AutoTP: the tp_plan entry {pattern!r}: {style!r} (module '{name}') is a style "
                                      "shardwise does not implement (colwise and rowwise are)")
        parent_name, _, child = name.rpartition(".")
        block = found.setdefault(parent_name, _Block(parent_name, model.get_submodule(parent_name)))
        (block.column if style == "colwise" else block.row).append(child)
    return [b for b in found.values() if b.column and b.row]


_PLAN_GATHERED = ("colwise_gather_output", "colwise_rep")


def gathered_columns(model: nn.Module, plan: dict[str, str] | None, tp_size: int, taken=frozenset()) -> list[str]:
    """The linears of ``model`` (module names) that its Hugging Face tp_plan marks ``colwise_gather_output`` (or
    the older ``colwise_rep``) and that can be split by their outputs over ``tp_size`` ranks: not in ``taken``
    (already sharded), outputs divisible by ``tp_size``, and a weight no other module holds (a head tied to the
    input embedding stays whole, since the embedding needs every row)."""
    if not plan or tp_size <= 1:
        return []
    rules = [(re.compile(re.escape(p.removeprefix("model.")).replace(r"\*", r"[^.]+") + "$"), style)
             for p, style in plan.items() if style in _PLAN_GATHERED]
    if not rules:
        return []
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    found = []
    for name, module in model.named_modules():
        if not name or name in taken or not _is_linear(module):
            continue
        if not any(rx.fullmatch(name.removeprefix("model.")) for rx, _ in rules):
            continue
        outputs = module.weight.shape[1 if is_conv1d(module) else 0]
        if outputs % tp_size or holders.get(id(module.weight), 0) > 1:
            log_dist(f"AutoTP: '{name}' ({'tied weight' if outputs % tp_size == 0 else f'{outputs} outputs'}) "
                     f"stays whole although its tp_plan gathers it", ranks=[0], level=logging.INFO)
            continue
        found.append(name)
    return found


def _sum_over_group(group):
    def hook(grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group)
        return grad
    return hook


def _sync_replicas(model: nn.Module, group, src_rank: int) -> None:
    """Every tensor rank starts from tensor rank 0's weights (a model built without a common seed would
    otherwise be sharded from different full weights)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, src=src_rank, group=group)


def shard_model(model: nn.Module, mp_group=None, *, src_rank: int | None = None, tp_size: int | None = None,
                tp_rank: int | None = None) -> nn.Module:
    """Shard ``model`` in place over ``mp_group`` (None: the whole world) and return it.

    ``src_rank`` is the global rank whose weights every tensor rank starts from (default: the group's
    first rank). Idempotent: a model already sharded (``model.ds_autotp_parsed``) is returned as is.
    """
    if getattr(model, "ds_autotp_parsed", False):
        return model
    size = tp_size if tp_size is not None else comm.get_world_size(mp_group)
    if size <= 1:
        return model
    check_head_counts(model, size)
    src = src_rank if src_rank is not None else comm.get_global_rank(mp_group, 0)
    _sync_replicas(model, mp_group, src)
    blocks = AutoTP(model, mp_group, tp_size=size, tp_rank=tp_rank)._replace_module(model)
    model.ds_autotp_parsed = True
    model.autotp_size = size
    heads = sum(1 for m in model.modules() if isinstance(m, LinearLayer) and m.gather_output)
    log_dist(f"AutoTP: sharded {len(blocks)} blocks of {type(model).__name__} over {size} tensor-parallel ranks, "
             f"{heads} output-gathered linears of its tp_plan (embeddings and norms replicated)", ranks=[0],
             level=logging.INFO)
    return model


def autotp_hook(module: nn.Module, grid) -> nn.Module:
    """The engine's hook: shard ``module`` over ``grid``'s tensor axis and check, on the first forward,
    that every rank of a tensor group was given the same batch (as DeepSpeed does)."""
    size = grid.get_tensor_model_parallel_world_size()
    if size <= 1 or getattr(module, "ds_autotp_parsed", False):
        return module
    group = grid.get_tensor_model_parallel_group()
    src = grid.get_tensor_model_parallel_src_rank()
    shard_model(module, group, src_rank=src, tp_size=size, tp_rank=grid.get_tensor_model_parallel_rank())
    _check_first_batch(module, group, src)
    return module


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b)  # other objects (caches, flags): only their kind must agree


def _check_first_batch(module: nn.Module, group, src: int) -> None:
    handle = None

    def check(mod, args, kwargs):
        handle.remove()
        theirs = comm.broadcast_object(_to_cpu((args, kwargs)), src=src, group=group)
        ok = torch.tensor([1.0 if _same(_to_cpu((args, kwargs)), theirs) else 0.0])
        comm.all_reduce(ok, op=comm.ReduceOp.MIN, group=group)
        if ok.item() != 1.0:
            raise ValueError("AutoTP: the ranks of a tensor-parallel group were given different batches on the "
                             "first forward; every rank of a tensor group must see the same inputs (the engine's "
                             "data loader does this: it splits data by data-parallel rank only)")

    handle = module.register_forward_pre_hook(check, with_kwargs=True, prepend=True)


def _to_cpu(obj):
    """Tensors and their containers, on the CPU; other objects become None (not compared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return [_to_cpu(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return None


# -- tp_model_init: DeepSpeed 0.19.8 records the arguments; initialize() shards ------------------------------

_TP_MODEL_INIT_ARGS: dict | None = None
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config=None, **kwargs) -> nn.Module:
    """Record AutoTP arguments for the next ``initialize`` and return ``model`` unchanged.

    As in DeepSpeed 0.19.8, sharding happens in ``initialize``: ``tp_size`` fills
    ``tensor_parallel.autotp_size`` when the config does not set it, and a different value there (or
    a config training in another dtype than ``dtype``) is an error. ``config`` is accepted and unused,
    as in DeepSpeed. ``tp_group=`` is refused: shardwise builds the tensor groups itself.
    """
    global _TP_MODEL_INIT_ARGS
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TypeError(f"tp_model_init() got unexpected keyword arguments {unknown}")
    if kwargs.get("tp_group") is not None:
        raise ValueError("tp_model_init(tp_group=...) is not supported: shardwise builds the tensor-parallel groups "
                         "from tp_size (consecutive ranks), drop tp_group")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"tp_model_init: dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                         f"got {dtype!r}")
    new = {"tp_size": tp_size, "dtype": dtype}
    if _TP_MODEL_INIT_ARGS is not None and _TP_MODEL_INIT_ARGS != new:
        raise ValueError(f"Conflicting tp_model_init arguments across calls: {_TP_MODEL_INIT_ARGS} then {new}")
    _TP_MODEL_INIT_ARGS = new
    return model


def merge_tp_model_init(cfg):
    """``cfg`` with the arguments of an earlier ``tp_model_init`` merged in (the config wins; a mismatch
    is an error, as in DeepSpeed)."""
    args = _TP_MODEL_INIT_ARGS
    if args is None:
        return cfg
    tp = cfg.tensor_parallel
    if tp.autotp_size not in (0, args["tp_size"]):
        raise ValueError(f"Conflicting tensor_parallel.autotp_size in config ({tp.autotp_size}) and tp_model_init "
                         f"({args['tp_size']})")
    trains_in = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else None
    wanted = _DTYPE_NAMES[args["dtype"]]
    if trains_in is not None and trains_in != wanted:
        raise ValueError(f"Conflicting dtype: the config trains in {trains_in} (its {trains_in} block) but "
                         f"tp_model_init requested {args['dtype']}")
    return cfg.model_copy(update={"tensor_parallel": tp.model_copy(update={"autotp_size": args["tp_size"]})})


def _reset_tp_model_init() -> None:
    global _TP_MODEL_INIT_ARGS
    _TP_MODEL_INIT_ARGS = None
