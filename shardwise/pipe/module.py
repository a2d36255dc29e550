"""``PipelineModule``: a model written as a list of layers, cut into pipeline stages.

Each rank builds only the layers of its own stage (``LayerSpec`` defers construction until
then); layers are registered under their global index (``"3.weight"``), so parameter names,
and therefore checkpoints, do not depend on the number of stages. ``TiedLayerSpec`` layers
sharing a ``key`` are one module per stage holding it; their weights start equal (broadcast
from the first stage holding them) and their gradients are summed over those stages.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn

from shardwise import checkpointing, comm
from shardwise.pipe.partition import check_boundaries, find_layer_type, partition_balanced, partition_uniform
from shardwise.topology import ParallelGrid, ProcessTopology

logger = logging.getLogger("shardwise")

__all__ = ["PipelineError", "LayerSpec", "TiedLayerSpec", "PipelineModule"]


class PipelineError(Exception):
    """Misuse of a pipeline (DeepSpeed's ``deepspeed.runtime.pipe.module.PipelineError``)."""


class LayerSpec:
    """A layer described by its class and constructor arguments, built only on the stage owning it."""

    def __init__(self, typename, *module_args, **module_kwargs) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec needs a torch.nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every occurrence with the same ``key`` (e.g. an embedding
    reused as the LM head). ``forward_fn(module, inputs)``, when given, replaces ``module(inputs)``."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr="weight",
                 **module_kwargs) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _layer_name(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _layer_type_name(layer) -> str | None:
    """The class name a ``type:<regex>`` partition method matches against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if hasattr(layer, "parameters") and hasattr(layer, "forward"):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: ``layers`` (LayerSpec, TiedLayerSpec, modules or callables)
    run in sequence, each one's output feeding the next, cut into ``num_stages`` stages.

    shardwise extensions (keyword-only): ``virtual_stages`` (model chunks per rank, for the
    interleaved schedule) and ``schedule`` (``"1f1b"`` default, ``"gpipe"``, ``"interleaved"``).
    """

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=checkpointing.checkpoint, checkpointable_layers=None, *,
                 virtual_stages: int = 1, schedule: str | None = None) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule needs num_stages or topology")
        if not comm.is_initialized():
            raise PipelineError("PipelineModule needs the process group: call shardwise.init_distributed() "
                                "(or deepspeed.init_distributed()) before building it")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ValueError("checkpointable_layers must be a list of layer class names")
        world = comm.get_world_size()
        if topology is None:
            if num_stages > 1 and world == 1:
                raise PipelineError(
                    f"PipelineModule(num_stages={num_stages}) runs one stage per process but this is a single "
                    f"process: launch with `shardwise run --num_procs {num_stages} script.py` (or use num_stages=1)")
            if world % num_stages:
                raise PipelineError(f"num_stages ({num_stages}) must divide the world size ({world})")
            topology = ProcessTopology(("pipe", "data"), (num_stages, world // num_stages))
        elif topology.world_size != world:
            raise PipelineError(f"topology {dict(zip(topology.axes, topology.dims))} has {topology.world_size} "
                                f"ranks but the world size is {world}")
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != self.num_stages:
            raise PipelineError(f"num_stages={num_stages} but the topology has {self.num_stages} pipe stages")
        self.virtual_stages = int(virtual_stages)
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
        schedule = schedule or ("interleaved" if self.virtual_stages > 1 else "1f1b")
        if schedule not in ("1f1b", "gpipe", "interleaved"):
            raise ValueError(f"schedule={schedule!r}: choose '1f1b', 'gpipe' or 'interleaved'")
        if (schedule == "interleaved") != (self.virtual_stages > 1):
            raise ValueError(f"schedule={schedule!r} with virtual_stages={self.virtual_stages}: the interleaved "
                             "schedule needs virtual_stages >= 2, and only it can run them")
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._checkpointable_by_chunk: list[list[bool]] = []  # per chunk, per block of the interval (below)
        self.is_checkpointable_results_interval: int | None = None

        self._grid = ParallelGrid.for_topology(topology)  # the user's grid, if already built for it
        self.global_rank = comm.get_rank()
        self.world_size = world
        self.stage_id = self._grid.axis_rank("pipe")
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        total = self.num_stages * self.virtual_stages
        if self._num_layers < total:
            raise PipelineError(
                f"{self._num_layers} layers cannot fill {total} pipeline stages"
                + (f" ({self.num_stages} stages x {self.virtual_stages} virtual)" if self.virtual_stages > 1 else "")
                + ": use fewer stages or more layers")
        with self._grid.active():  # tensor-parallel layers in the specs cut themselves over this grid
            self.parts = self._partition(partition_method, total)
        # Chunk c of this rank is virtual stage c * num_stages + stage_id.
        self._chunk_bounds = [(self.parts[c * self.num_stages + self.stage_id],
                               self.parts[c * self.num_stages + self.stage_id + 1])
                              for c in range(self.virtual_stages)]
        self._local_start, self._local_stop = self._chunk_bounds[0][0], self._chunk_bounds[-1][1]
        self.forward_funcs: list[list[Callable]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        with self._grid.active():
            self._build()
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()
        self._precompute_checkpointable_values()

    # -- partitioning -----------------------------------------------------------------------------
    def _partition(self, method, total: int) -> list[int]:
        n = self._num_layers
        if isinstance(method, (list, tuple)):
            return check_boundaries(method, n, total)
        m = str(method).lower()
        if m == "uniform":
            return partition_uniform(n, total)
        if m == "parameters":
            return partition_balanced(self._count_layer_params(), total)
        if m.startswith("type:"):
            pattern = str(method)[len("type:"):]
            hits = set(find_layer_type([_layer_type_name(x) for x in self._layer_specs], pattern))
            if not hits:
                raise ValueError(f"partition_method={method!r}: no layer class name matches {pattern!r} "
                                 f"(layers: {sorted({_layer_name(x) for x in self._layer_specs})})")
            return partition_balanced([1 if i in hits else 0 for i in range(n)], total)
        raise NotImplementedError(f"partition_method={method!r}: use 'parameters', 'uniform', 'type:<regex>' "
                                  "or a list of layer boundaries")

    def _count_layer_params(self) -> list[int]:
        counts = []
        for layer in self._layer_specs:
            if isinstance(layer, LayerSpec):
                with torch.device("meta"):  # count without allocating or initialising weights
                    module = layer.build()
            elif isinstance(layer, nn.Module):
                module = layer
            else:
                counts.append(0)
                continue
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
        return counts

    # -- building ---------------------------------------------------------------------------------
    def _build(self) -> None:
        for start, stop in self._chunk_bounds:
            funcs = []
            for idx in range(start, stop):
                layer = self._layer_specs[idx]
                if self.seed_layers:
                    (self.seed_fn or _seed_everything)(self.base_seed + idx)
                if isinstance(layer, PipelineModule):
                    raise NotImplementedError("a PipelineModule inside a PipelineModule is not supported")
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        self.tied_modules[layer.key] = layer.build()
                        self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                        for attr in layer.tied_weight_attr:
                            try:
                                self._recursive_getattr(self.tied_modules[layer.key], attr)
                            except AttributeError:
                                raise PipelineError(f"layer {idx}: TiedLayerSpec({layer.key!r}, "
                                                    f"{layer.typename.__name__}) has no attribute {attr!r} "
                                                    "(tied_weight_attr)") from None
                    module = self.tied_modules[layer.key]
                    funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
                elif isinstance(layer, LayerSpec):
                    module = layer.build()
                    self.add_module(str(idx), module)
                    funcs.append(module)
                elif isinstance(layer, nn.Module):
                    self.add_module(str(idx), layer)
                    funcs.append(layer)
                elif callable(layer):
                    funcs.append(layer)
                else:
                    raise PipelineError(f"layer {idx} is a {type(layer).__name__}: a layer must be a LayerSpec, "
                                        "a TiedLayerSpec, a torch.nn.Module or a callable")
            self.forward_funcs.append(funcs)

    @staticmethod
    def _recursive_getattr(module: nn.Module, attr: str):
        for part in attr.split("."):
            module = getattr(module, part)
        return module

    def _tie_stages(self) -> dict[str, list[int]]:
        """Tie key -> the (real) stages holding it, from the specs (the same on every rank)."""
        stages: dict[str, set[int]] = {}
        for vs in range(self.num_stages * self.virtual_stages):
            for idx in range(self.parts[vs], self.parts[vs + 1]):
                layer = self._layer_specs[idx]
                if isinstance(layer, TiedLayerSpec):
                    stages.setdefault(layer.key, set()).add(vs % self.num_stages)
        return {k: sorted(v) for k, v in sorted(stages.items(), key=lambda kv: str(kv[0]))}

    def _index_tied_modules(self) -> dict:
        """The grid's process groups summing each tied module's gradients over the stages holding it (created
        by the grid, every key in the same order on every rank)."""
        comms = {}
        for key, stages in self._tie_stages().items():
            if len(stages) < 2:
                continue
            group, ranks = self._grid.tied_group(stages)
            if self.global_rank in ranks:
                comms[key] = {"ranks": ranks, "group": group, "owner": ranks[0]}
        return comms

    def _tied_params(self, key) -> list[torch.nn.Parameter]:
        return list(self.tied_modules[key].parameters())

    def _synchronize_tied_weights(self) -> None:
        with torch.no_grad():
            for key, c in self.tied_comms.items():
                for p in self._tied_params(key):
                    comm.broadcast(p.data, src=c["owner"], group=c["group"])

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of every tied module over the stages holding it."""
        for key, c in self.tied_comms.items():
            for p in self._tied_params(key):
                if p.grad is not None:
                    comm.all_reduce(p.grad, group=c["group"])

    def tied_duplicate_names(self) -> set[str]:
        """Names of tied parameters this rank holds but does not own (another stage counts them once)."""
        out = set()
        for key, c in self.tied_comms.items():
            if c["owner"] != self.global_rank:
                out.update(f"tied_modules.{key}.{n}" for n, _ in self.tied_modules[key].named_parameters())
        return out

    # -- running ----------------------------------------------------------------------------------
    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from the next forward on (0: no activation checkpointing)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval: interval must be an integer >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    @property
    def activation_checkpoint_interval(self) -> int:
        return self._checkpoint_interval

    @activation_checkpoint_interval.setter
    def activation_checkpoint_interval(self, interval: int) -> None:
        # Setting it (the engine does from the config, a user may) decides the blocks at once: forward only
        # reads them (it changes no state, so a compiled forward keeps one graph).
        self._checkpoint_interval = int(interval)
        if "forward_funcs" in self.__dict__:
            self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """Decide, once per interval, which blocks of ``activation_checkpoint_interval`` layers forward
        checkpoints (``is_checkpointable_results``: chunk 0's, as DeepSpeed's attribute)."""
        interval = self.activation_checkpoint_interval
        if interval <= 0 or self.is_checkpointable_results_interval == interval:
            return
        self._checkpointable_by_chunk = [[self._is_checkpointable(funcs[start:start + interval])
                                          for start in range(0, len(funcs), interval)] for funcs in self.forward_funcs]
        self.is_checkpointable_results_interval = interval

    @property
    def is_checkpointable_results(self) -> list[bool]:
        return self._checkpointable_by_chunk[0] if self._checkpointable_by_chunk else []

    def _is_checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def forward(self, forward_input, chunk: int = 0):
        funcs = self.forward_funcs[chunk]

        def run(start, end):
            def exec_range(*inputs):
                x = inputs[0] if len(inputs) == 1 else inputs
                for f in funcs[start:end]:
                    x = f(x)
                return x
            return exec_range

        interval = self.activation_checkpoint_interval
        if interval <= 0:
            return run(0, len(funcs))(forward_input)
        x = forward_input
        for start, checkpointable in zip(range(0, len(funcs), interval), self._checkpointable_by_chunk[chunk]):
            end = min(start + interval, len(funcs))
            args = x if isinstance(x, tuple) else (x,)
            if checkpointable:
                x = self.activation_checkpoint_func(run(start, end), *args)
            else:
                x = run(start, end)(*args)
        return x

    # -- introspection ----------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> ParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def chunk_layers(self, chunk: int = 0) -> range:
        """Global indices of the layers of one of this rank's chunks."""
        return range(*self._chunk_bounds[chunk])

    def stage_output_layer(self, chunk: int = 0) -> str:
        """``"layer 3 (Linear)"``: the layer whose output leaves this chunk (for error messages)."""
        idx = self._chunk_bounds[chunk][1] - 1
        return f"layer {idx} ({_layer_name(self._layer_specs[idx])})"

    def describe_partition(self) -> str:
        lines = []
        for vs in range(self.num_stages * self.virtual_stages):
            a, b = self.parts[vs], self.parts[vs + 1]
            names = ", ".join(f"{i}:{_layer_name(self._layer_specs[i])}" for i in range(a, b))
            lines.append(f"stage={vs % self.num_stages}" + (f" chunk={vs // self.num_stages}" if
                                                           self.virtual_stages > 1 else "") + f" layers={b - a} [{names}]")
        return "\n".join(lines)


def build_sequential(layers: Sequence, *, seed_layers: bool = False, base_seed: int = 1234, seed_fn=None):
    """The same layers as one plain ``nn.Sequential`` (no pipeline), seeded as ``PipelineModule`` seeds
    them. Parameter names match the pipeline's (``"<layer index>.<name>"``) for untied layers; a
    tied key is built once (at its first occurrence) and reused."""
    modules, tied = [], {}
    for idx, layer in enumerate(layers):
        if seed_layers:
            (seed_fn or _seed_everything)(base_seed + idx)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in tied:
                tied[layer.key] = layer.build()
            module = tied[layer.key]
            modules.append(module if layer.forward_fn is None else _Fn(partial(layer.forward_fn, module), module))
        elif isinstance(layer, LayerSpec):
            modules.append(layer.build())
        elif isinstance(layer, nn.Module):
            modules.append(layer)
        else:
            modules.append(_Fn(layer))
    return nn.Sequential(*modules)


class _Fn(nn.Module):
    def __init__(self, fn, owner: nn.Module | None = None) -> None:
        super().__init__()
        self.fn = fn
        if owner is not None:
            self.owner = owner

    def forward(self, x):
        return self.fn(x)
