"""DeepSpeed's own checkpoints (``save_checkpoint`` of DeepSpeed 0.1x) as shardwise checkpoints.

A DeepSpeed checkpoint folder ``<dir>/<tag>/`` holds (``deepspeed/runtime/engine.py``):

* ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (ZeRO-3, one per rank): ``module`` (the state dict in the training dtype; at ZeRO-3 parameters
  are empty placeholders), ``param_shapes`` (per param group, name -> shape in flat order),
  ``buffer_names``, ``frozen_param_shapes``/``frozen_param_fragments`` (ZeRO 2/3), ``shared_params``,
  ``lr_scheduler``, ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``,
  ``mp_world_size``, ``ds_config``, ``ds_version``, the ZeRO-0 ``optimizer`` and the client's keys;
* ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (ZeRO 1-3), ``optimizer_state_dict``:
  ZeRO-1/2 (``stage_1_and_2.py``) and bf16 ZeRO-1 (``bf16_optimizer.py``) keep per param group one
  flat fp32 buffer, the group's parameters end to end (plus ``param_alignment_paddings``), padded
  at the end to a multiple of 2 x world size and cut into equal partitions: rank r's is
  ``single_partition_of_fp32_groups`` (ZeRO-1/2 drop the padding, ``group_paddings``) and its
  Adam moments are ``base_optimizer_state``.  ZeRO-3 (``stage3.py``) cuts every parameter on its
  own into ``ceil(numel / world)`` pieces; rank r's pieces, end to end in ``param_shapes`` order,
  are ``fp32_flat_groups`` (sub-groups) with moments in ``optimizer_state_dict``.

A pipeline (``PipelineEngine``) checkpoint has no ``module``: each layer's state dict is its own
``layer_<i>-model_states.pt`` (layer i is the submodule ``str(i)``, so its ``weight`` is ``i.weight``), and
each stage s is ``mp_rank_<s>`` in the other files' names, its optimizer read as a data-parallel one.

Each rank's flat data is cut into (parameter name, flat range) fragments, exactly what
shardwise's own checkpoints store, and written as a native checkpoint (``deepspeed_import.convert_deepspeed_checkpoint``);
``engine.load_checkpoint`` does that into a temporary folder and loads it with the ordinary
loader, which reshards to any world size and ZeRO stage (``loading.py`` tells the formats apart).  Files are read with the restricted
unpickler of ``safe_unpickle.py``.  MoE checkpoints (expert files beside these) are read by ``deepspeed_moe.py``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.checkpoint.files import write_tensors
from shardwise.checkpoint.fragments import index_fragments
from shardwise.checkpoint.manifest import FORMAT, VERSION, read_latest
from shardwise.checkpoint.safe_unpickle import load_deepspeed_file
from shardwise.checkpoint.serialize import split_state
from shardwise.version import __version__

logger = logging.getLogger("shardwise")

# Keys DeepSpeed writes into the model-states file; everything else there is the client's state.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers",
})
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
# PipelineModule's per-layer files: layer_<index>[-model_<tensor-parallel rank>]-model_states.pt
_PIPELINE_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


class DeepSpeedLayoutError(ValueError):
    """A DeepSpeed checkpoint whose layout this reader does not know (the message names the field)."""


# ---------------------------------------------------------------------------------------------
# finding the folder


def find_deepspeed_folder(load_dir, tag=None) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint in ``load_dir`` (``tag`` or ``latest``), or
    ``load_dir`` itself when it is one; None when it is not a DeepSpeed checkpoint."""
    load_dir = Path(load_dir)
    candidates = []
    if tag is None:
        tag = read_latest(load_dir)  # a ValueError naming the file when it is not one folder's name
    if tag is None:
        tag = read_latest(load_dir, name="latest_universal")  # ds_to_universal.py's output
    if tag is not None:
        candidates.append(load_dir / str(tag))
    candidates.append(load_dir)
    for folder in candidates:
        if folder.is_dir() and not (folder / "manifest.json").exists() and \
                any(p.is_file() and (_MODEL_STATES.match(p.name) or _PIPELINE_LAYER.match(p.name))
                    for p in folder.iterdir()):
            return folder
    return None


def is_deepspeed_checkpoint(load_dir, tag=None) -> bool:
    return find_deepspeed_folder(load_dir, tag) is not None


def pipeline_module_keys(folder: Path) -> set[str] | None:
    """The module names of a DeepSpeed pipeline checkpoint's layer files (``"<layer>.<key>"``) and its tied
    modules' (``tied_modules.<key>.<name>``, as the stages' optimizers name them), or None when ``folder`` has
    no layer files (they are small: one layer's weights each)."""
    keys = set()
    for path in folder.iterdir():
        if m := _PIPELINE_LAYER.match(path.name):
            sd = load_deepspeed_file(path)
            keys.update(f"{int(m.group(1))}.{k}" for k in (sd if isinstance(sd, dict) else {}))
        elif (m := _MODEL_STATES.match(path.name)) and m.group(1) is None:  # a stage's: tied modules by name
            ms = load_deepspeed_file(path)
            for g in (ms.get("param_shapes") or []) if isinstance(ms, dict) else []:
                keys.update(k for k in dict(g) if k.startswith("tied_modules."))  # (read from a layer file)
    return keys if any(_PIPELINE_LAYER.match(p.name) for p in folder.iterdir()) else None


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class _Out:
    """The native checkpoint being written into ``tmp``: fragment files (written one DeepSpeed rank at
    a time by :meth:`flush`, so memory holds one rank's partition), their checksums, descriptors."""

    tmp: Path
    files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    written: dict[str, tuple[str, int]] = field(default_factory=dict)
    descs: list[dict] = field(default_factory=list)

    def flush(self) -> None:
        for name, tensors in self.files.items():
            self.written[name] = (write_tensors(self.tmp / name, tensors, copy=False), 0)
        self.files = {}

    skip: set[str] = field(default_factory=set)  # names an earlier pipeline stage wrote (tied layers)

    def fragment(self, rank: int, name: str, shape, start: int, end: int, master: torch.Tensor | None,
                 states: dict[str, torch.Tensor]) -> None:
        if name in self.skip:
            return
        key = f"{name}@{start}:{end}"
        base = {"name": name, "shape": [int(d) for d in shape], "start": start, "end": end}
        if master is not None:
            mfile = f"master_rank{rank}.safetensors"
            self.files.setdefault(mfile, {})[key] = master.detach().float().reshape(-1).clone()
            self.descs.append({**base, "kind": "master", "file": mfile, "key": key, "dtype": "float32"})
        ofile = f"optim_rank{rank}.safetensors"
        for state, value in states.items():
            skey = f"{key}/{state}"
            self.files.setdefault(ofile, {})[skey] = value.detach().clone()
            self.descs.append({**base, "kind": "optim", "state": state, "scalar": value.dim() == 0, "file": ofile,
                               "key": skey, "dtype": str(value.dtype).removeprefix("torch.")})


def _need(d: dict, key: str, where) -> object:
    if not isinstance(d, dict) or key not in d:
        raise DeepSpeedLayoutError(f"{where}: field '{key}' missing (this reader follows the layout of DeepSpeed "
                                   "0.1x's save_checkpoint)")
    return d[key]


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))


def _split_states(state: dict, lo: int, hi: int, where: str) -> dict[str, torch.Tensor]:
    """Elements [lo, hi) of each per-element optimizer state; scalars (Adam's step) as they are."""
    out = {}
    for k, v in _tensor_states(state, where).items():
        out[k] = v if v.dim() == 0 else v.reshape(-1)[lo:hi]
    return out


def _tensor_states(state: dict, where) -> dict[str, torch.Tensor]:
    """FusedAdam and DeepSpeedCPUAdam (what DeepSpeed builds for "Adam"/"AdamW" on GPUs and with
    offload_optimizer) keep ``step`` as a Python int: as torch's 0-dim float tensor."""
    out = {}
    for k, v in state.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = torch.tensor(float(v))
        if not isinstance(v, torch.Tensor):
            raise DeepSpeedLayoutError(f"{where}: optimizer state '{k}' is a {type(v).__name__}, not a tensor")
        out[k] = v
    return out


def _flat_states(opt_sd, count: int, where) -> list[dict]:
    """Per flat group, its optimizer state: a torch state_dict ``{'state': {i: ..}, ...}`` or the
    'elastic' list of lean states (plus ``base_optimizer_state_step``)."""
    if isinstance(opt_sd, list):  # zero_optimization.elastic_checkpoint
        return [_tensor_states(s, where) for s in opt_sd]
    state = _need(opt_sd, "state", where)
    return [_tensor_states(state.get(i, {}), where) for i in range(count)]


def _universal_tensor(path: Path, shape) -> torch.Tensor:
    """One ``ds_to_universal.py`` file: ``{'param': whole tensor, 'cat_dim': ..}`` (or the tensor itself)."""
    obj = load_deepspeed_file(path)
    t = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(t, torch.Tensor) or t.numel() != _numel(shape):
        raise DeepSpeedLayoutError(f"{path}: expected field 'param' with {_numel(shape)} elements (shape "
                                   f"{list(shape)}), found {getattr(t, 'shape', type(t).__name__)}")
    return t.reshape(-1)


def _saved_step(osd: dict):
    """The step count in a universal ``optimizer_state.pt``: its (rank 0) optimizer state's, else a group's."""
    inner = osd.get("optimizer_state_dict")
    for st in (inner.get("state", {}).values() if isinstance(inner, dict) else []):
        if isinstance(st, dict) and "step" in st:
            return st["step"]
    for g in osd.get("param_groups") or []:
        if "step" in g:
            return g["step"]
    return None


class _Reader:
    def __init__(self, folder: Path, param_names: list[str] | None, tmp: Path) -> None:
        self.folder = folder
        self.param_names = param_names
        self.out = _Out(tmp)
        names = sorted(p.name for p in folder.iterdir())
        layers = {n: m for n in names if (m := _PIPELINE_LAYER.match(n))}
        mp = sorted({int(m.group(2)) for n in names if (m := _MODEL_STATES.match(n))})
        self.pipeline = bool(layers)
        self.mp, self.rank_base = 0, 0  # the model-states index (a pipeline's stage) being read, its first rank
        if self.pipeline:
            tp = sorted({int(m.group(2) or 0) for m in layers.values()})
            if tp != [0]:
                raise ValueError(f"{folder} is a DeepSpeed pipeline checkpoint with tensor-parallel layer slices "
                                 f"(layer_*-model_<rank>-model_states.pt for model ranks {tp}): shardwise reads "
                                 "pipeline checkpoints without tensor parallelism only")
        elif mp != [0]:
            raise ValueError(f"{folder} holds tensor-parallel model-states files for mp ranks {mp}: shardwise reads "
                             "DeepSpeed checkpoints without tensor (model) parallelism only")
        first = folder / "mp_rank_00_model_states.pt"
        if not first.exists() and self.pipeline:
            raise FileNotFoundError(f"DeepSpeed pipeline checkpoint {folder}: stage 0's {first.name} is missing")
        if not first.exists():
            first = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        self.ms_path = first
        self.ms = load_deepspeed_file(first)
        if not isinstance(self.ms, dict):
            raise DeepSpeedLayoutError(f"{first}: expected a dict of DeepSpeed states, found {type(self.ms).__name__}")
        for key in ("module", "global_steps", "dp_world_size"):
            _need(self.ms, key, first)
        dims = self.ms.get("checkpoint_parallel_dimensions") or {}
        pp, tp = int(dims.get("pp_degree", 1)), int(dims.get("tp_degree", 1))
        mpw = int(self.ms.get("mp_world_size", 1))
        if self.pipeline:
            self.stages = self._pipeline_stages(mp, pp if dims else mpw, tp)
        elif pp > 1 or tp > 1 or mpw > 1:
            raise ValueError(f"{first}: saved with pipeline degree {pp}, tensor-parallel degree {max(tp, mpw)}; "
                             "shardwise reads DeepSpeed checkpoints of pure data parallelism only (the pipeline "
                             "stage and tensor-slice mapping are missing here)")
        self.cfg = self.ms.get("ds_config") if isinstance(self.ms.get("ds_config"), dict) else {}
        self.world = int(self.ms["dp_world_size"])
        self.module: dict[str, torch.Tensor] = self._layer_weights(layers) if self.pipeline else dict(self.ms["module"])
        # The stage from the files (ds_config may be a path, not a dict); ZeRO-1 vs 2 from 'zero_stage' later.
        if first.name.startswith("zero_pp_rank_"):
            self.stage = 3
        elif any("optim_states" in n for n in names):
            self.stage = int((self.cfg.get("zero_optimization") or {}).get("stage", 1)) or 1
        else:
            self.stage = 0
        self.fp16 = bool((self.cfg.get("fp16") or {}).get("enabled", False)) or \
            any(v.dtype == torch.float16 for v in self.module.values())
        self.buffers = set(self.ms.get("buffer_names") or [])
        self.total_ranks = self.world
        self.aliases = dict(self.ms.get("shared_params") or {})
        self.param_shapes = [dict(g) for g in (self.ms.get("param_shapes") or [])]

    # -- pipelines: PipelineModule's layer files -------------------------------------------------
    def _pipeline_stages(self, mp: list[int], pp: int, tp: int) -> list[int]:
        """The stages (model-states indices; the pipeline's stage when there is no tensor parallelism)."""
        if tp > 1:
            raise ValueError(f"{self.ms_path}: a pipeline saved with tensor-parallel degree {tp}; shardwise reads "
                             "DeepSpeed pipeline checkpoints without tensor parallelism only")
        missing = [f"mp_rank_{s:02d}_model_states.pt" for s in range(max(pp, len(mp))) if s not in mp]
        if missing:
            raise FileNotFoundError(f"DeepSpeed pipeline checkpoint {self.folder} was saved by {pp} stages but "
                                    f"{', '.join(missing)} (one per stage) missing")
        return mp

    def _layer_weights(self, layers: dict) -> dict[str, torch.Tensor]:
        """The layer files' state dicts as the PipelineModule's: layer i's ``key`` is ``"<i>.<key>"``
        (DeepSpeed's and shardwise's PipelineModule both register layer i as the submodule ``str(i)``)."""
        module = {}
        for name, m in sorted(layers.items(), key=lambda kv: int(kv[1].group(1))):
            sd = load_deepspeed_file(self.folder / name)
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise DeepSpeedLayoutError(f"{self.folder / name}: expected a layer's state dict (names -> tensors), "
                                           f"found {type(sd).__name__}")
            module.update({f"{int(m.group(1))}.{k}": v for k, v in sd.items()})
        return module

    def _check_layers(self) -> None:
        """Every parameter the stages' optimizers hold has its weight in a layer file."""
        for name in self.trainable:
            if name not in self.module:
                idx = name.split(".", 1)[0]
                where = (f"layer_{int(idx):02d}-model_states.pt holds no '{name.split('.', 1)[1]}'"
                         if idx.isdigit() and any(k.startswith(f"{idx}.") for k in self.module) else
                         f"its layer file layer_{int(idx):02d}-model_states.pt is missing" if idx.isdigit() else
                         "it is neither in a numbered layer nor a tied module found in a layer file")
                raise FileNotFoundError(f"DeepSpeed pipeline checkpoint {self.folder}: parameter {name} of stage "
                                        f"{self.mp} ({self.ms_path.name}): {where}")

    def _tie_layers(self) -> None:
        """Name the tied modules' weights. DeepSpeed saves a ``TiedLayerSpec`` used without ``forward_fn``
        as that layer's file (``layer_<i>``), which does not say its tie key; the stages' optimizers name
        the tied parameters (``tied_modules.<key>.<name>``) and not the layer. A layer file whose weights
        no stage's optimizer names as ``<i>.<name>`` is the tied module whose names and shapes it has."""
        shapes = {}
        for stage in self.stages:
            path = self.folder / f"mp_rank_{stage:02d}_model_states.pt"
            ms = self.ms if stage == self.stages[0] else load_deepspeed_file(path)
            for g in ms.get("param_shapes") or []:
                shapes.update({k: tuple(v) for k, v in dict(g).items()})
        ties: dict[str, dict[str, tuple]] = {}
        for name, shape in shapes.items():
            if name.startswith("tied_modules."):
                key, _, rest = name[len("tied_modules."):].partition(".")
                ties.setdefault(key, {})[rest] = shape
        wanted = {n for n in self.param_names or [] if n.startswith("tied_modules.")}
        if not ties:
            if wanted:
                raise ValueError(f"{self.folder}: loading into a model with tied layers ({', '.join(sorted(wanted))}), "
                                 "but no stage of this DeepSpeed pipeline checkpoint names a tied module in its "
                                 "optimizer states (a model without them saved it, or ZeRO-0, which names nothing)")
            return
        if self.stage == 0:
            raise ValueError(f"{self.folder}: a ZeRO-0 DeepSpeed pipeline checkpoint with tied layers "
                             f"({', '.join(sorted(ties))}): its optimizer names no parameters, so the tied "
                             "weights cannot be matched; DeepSpeed's ZeRO-1 pipeline checkpoints can be read")
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in self.module.items():
            idx, _, rest = name.partition(".")
            layers.setdefault(int(idx), {})[rest] = value
        found: dict[str, int] = {}
        for idx, sd in sorted(layers.items()):
            if any(f"{idx}.{k}" in shapes for k in sd):
                continue
            layout = {k: tuple(v.shape) for k, v in sd.items()}
            keys = [key for key, tied in ties.items() if tied == {k: layout[k] for k in tied if k in layout}
                    and set(tied) <= set(layout)]
            if len(keys) > 1:
                raise DeepSpeedLayoutError(f"{self.folder}: layer_{idx:02d}-model_states.pt could hold tied module "
                                           f"{' or '.join(keys)} (same names and shapes): the files do not say which")
            if keys and keys[0] not in found:
                found[keys[0]] = idx
                for k, v in sd.items():
                    del self.module[f"{idx}.{k}"]
                    self.module[f"tied_modules.{keys[0]}.{k}"] = v
        missing = sorted(set(ties) - set(found))
        if missing:
            raise FileNotFoundError(f"DeepSpeed pipeline checkpoint {self.folder}: no layer file holds the weights of "
                                    f"tied module(s) {', '.join(missing)} (shapes {[ties[k] for k in missing]})")

    def _read_pipeline(self) -> None:
        """Each stage's optimizer partitions, as its own data-parallel ZeRO-1 checkpoint would be read. A tied
        module is in the optimizer of every stage using it: the first stage's copy is the one read."""
        self._tie_layers()
        trainable, base = [], 0
        for stage in self.stages:
            self.mp, self.rank_base = stage, base
            self.ms_path = self.folder / f"mp_rank_{stage:02d}_model_states.pt"
            ms = self.ms if stage == self.stages[0] else load_deepspeed_file(self.ms_path)
            self.world = int(_need(ms, "dp_world_size", self.ms_path))
            self.buffers |= set(ms.get("buffer_names") or [])
            self.param_shapes = [dict(g) for g in (ms.get("param_shapes") or [])]
            if self.stage == 0:  # the stage's optimizer holds the next parameters in layer order
                try:
                    self._read_stage0(ms.get("optimizer"), params=[k for k in self.module if k not in self.buffers
                                                                   and k not in trainable])
                except DeepSpeedLayoutError as e:
                    held = sorted({int(k.split(".", 1)[0]) for k in self.module})
                    raise DeepSpeedLayoutError(f"{e} (stage {stage}; the layer files with weights are those of "
                                               f"layers {held}: a missing layer file shifts this matching)") from None
            else:
                self._read_flat_partitions()
            self._check_layers()
            trainable += [n for n in self.trainable if n not in self.out.skip]
            self.out.skip |= set(self.trainable)
            base += self.world
        self.trainable, self.total_ranks = trainable, base

    # -- file names ------------------------------------------------------------------------
    def optim_path(self, rank: int) -> Path:
        mp = f"{self.mp:02d}"
        for prefix in ("", "bf16_"):
            for sep in ("_", ""):  # DeepSpeed's old name lacked the underscore before optim_states
                p = self.folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp}{sep}optim_states.pt"
                if p.exists():
                    return p
        raise FileNotFoundError(f"DeepSpeed checkpoint {self.folder} was saved by {self.world} data-parallel ranks "
                                f"but rank {rank}'s optimizer file zero_pp_rank_{rank}_mp_rank_{mp}_optim_states.pt "
                                "(or bf16_zero_pp_rank_...) is missing")

    def model_states_path(self, rank: int) -> Path:
        p = self.folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        if not p.exists():
            raise FileNotFoundError(f"DeepSpeed ZeRO-3 checkpoint {self.folder} was saved by {self.world} ranks but "
                                    f"rank {rank}'s {p.name} is missing")
        return p

    # -- optimizer state -------------------------------------------------------------------
    def read(self) -> None:
        self.param_groups = None
        self.loss_scaler = None
        if self.pipeline:
            self._read_pipeline()
        elif (self.folder / "zero" / "optimizer_state.pt").is_file():
            self._read_universal()
        elif self.stage == 0:
            self._read_stage0(self.ms.get("optimizer"))
        elif self.stage == 3:
            self._read_stage3()
        else:
            self._read_flat_partitions()
        self.out.flush()

    def _partition_states(self, osd, base, count: int, path, rank: int):
        """A ZeRO-1/2 optimizer file's per-group flat states (with the step count), its alignment paddings
        and slice mappings; rank 0's also gives the groups' settings and the loss scaler."""
        states = _flat_states(base, count, path)
        if "base_optimizer_state_step" in osd:
            for s in states:
                s.setdefault("step", torch.tensor(float(osd["base_optimizer_state_step"])))
        if rank == 0:
            self._groups_hyper(base, count)
            self._scaler(osd.get("loss_scaler"))
        return states, osd.get("param_alignment_paddings"), osd.get("param_slice_mappings")

    def _groups_hyper(self, opt_sd, count: int = 1) -> None:
        if isinstance(opt_sd, dict) and "param_groups" in opt_sd:
            # (FusedAdam / DeepSpeedCPUAdam groups also carry 'bias_correction' and a 'step' they never use)
            self.param_groups = [{k: v for k, v in g.items() if k not in ("params", "step")}
                                 for g in opt_sd["param_groups"]]
            return
        # zero_optimization.elastic_checkpoint saves no param groups: the config's optimizer settings
        params = dict((self.cfg.get("optimizer") or {}).get("params") or {})
        hyper = {k: tuple(v) if k == "betas" else v for k, v in params.items()
                 if k in ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad")}
        logger.warning("%s: no optimizer param groups saved (elastic_checkpoint); using the config's %s", self.folder,
                       hyper)
        self.param_groups = [dict(hyper) for _ in range(count)]

    def _scaler(self, obj) -> None:
        """DeepSpeed's LossScaler/DynamicLossScaler (a stand-in) or FP16_Optimizer's keys, as shardwise's."""
        if not self.fp16 or obj is None:
            return
        get = (lambda k, d=None: getattr(obj, k, d)) if not isinstance(obj, dict) else obj.get
        dynamic = bool(get("dynamic", get("dynamic_loss_scale", False)))
        if not dynamic:
            self.loss_scaler = {"type": "static", "cur_scale": float(get("cur_scale", 1.0))}
            return
        hyst = int((self.cfg.get("fp16") or {}).get("hysteresis", 2))
        self.loss_scaler = {"type": "dynamic", "cur_scale": float(get("cur_scale")),
                            "cur_iter": int(get("cur_iter", 0)),
                            "last_overflow_iter": int(get("last_overflow_iter", -1)),
                            "cur_hysteresis": int(get("cur_hysteresis", hyst))}

    def _read_flat_partitions(self) -> None:
        """ZeRO-1/2 and bf16 ZeRO-1: per group, rank r's slice of the end-to-end flat buffer."""
        if not self.param_shapes:
            raise DeepSpeedLayoutError(f"{self.ms_path}: field 'param_shapes' missing or empty")
        starts = [0] * len(self.param_shapes)  # global start of the next rank's partition, per group
        for rank in range(self.world):
            path = self.optim_path(rank)
            osd = _need(load_deepspeed_file(path), "optimizer_state_dict", path)
            parts = _need(osd, "single_partition_of_fp32_groups", path)
            if len(parts) != len(self.param_shapes):
                raise DeepSpeedLayoutError(f"{path}: field 'single_partition_of_fp32_groups' has {len(parts)} groups, "
                                           f"'param_shapes' of {self.ms_path.name} {len(self.param_shapes)}")
            if "zero_stage" in osd:
                self.stage = int(osd["zero_stage"])
            count = osd.get("partition_count")
            count = max(count) if isinstance(count, list) else count
            if count is not None and int(count) != self.world:
                raise DeepSpeedLayoutError(f"{path}: field 'partition_count' is {count} but dp_world_size {self.world}")
            base = _need(osd, "base_optimizer_state", path)
            states, align, mappings = self._partition_states(osd, base, len(parts), path, rank)
            for g, (shapes, part) in enumerate(zip(self.param_shapes, parts)):
                part = part.reshape(-1)
                lo_r, hi_r = starts[g], starts[g] + part.numel()
                off = 0
                seen = {}
                for j, (name, shape) in enumerate(shapes.items()):
                    n = _numel(shape)
                    lo, hi = max(off, lo_r), min(off + n, hi_r)
                    if lo < hi:
                        self.out.fragment(self.rank_base + rank, name, shape, lo - off, hi - off,
                                          part[lo - lo_r:hi - lo_r],
                                          _split_states(states[g], lo - lo_r, hi - lo_r, f"{path} group {g}"))
                        seen[name] = (hi - lo, lo - lo_r)
                    off += n + (int(align[g][j]) if align else 0)
                if mappings is not None and g < len(mappings):
                    saved = {k: (int(v.numel), int(v.start)) for k, v in mappings[g].items()}
                    if saved != seen:
                        raise DeepSpeedLayoutError(
                            f"{path}: field 'param_slice_mappings' of group {g} does not match the layout derived from "
                            f"'param_shapes' (saved {saved}, derived {seen})")
                starts[g] = hi_r
            self.out.flush()
        for g, shapes in enumerate(self.param_shapes):
            need = sum(_numel(s) for s in shapes.values())
            if starts[g] < need:
                raise DeepSpeedLayoutError(f"{self.folder}: 'single_partition_of_fp32_groups' of group {g} hold "
                                           f"{starts[g]} elements over all ranks, 'param_shapes' need {need}")
        self.trainable = [n for shapes in self.param_shapes for n in shapes]

    def _read_stage3(self) -> None:
        shapes = {k: v for g in self.param_shapes for k, v in g.items()}
        if not shapes:
            raise DeepSpeedLayoutError(f"{self.ms_path}: field 'param_shapes' missing or empty")
        frozen_shapes = dict(self.ms.get("frozen_param_shapes") or {})
        frozen_parts: dict[str, list[torch.Tensor]] = {n: [] for n in frozen_shapes}
        full = {name: torch.empty(_numel(s), dtype=self.module[name].dtype if name in self.module else torch.float32)
                for name, s in shapes.items()}  # the whole weights in the training dtype, for 'module'
        for rank in range(self.world):
            if frozen_shapes:
                ms = self.ms if rank == 0 else load_deepspeed_file(self.model_states_path(rank))
                frags = _need(ms, "frozen_param_fragments", self.model_states_path(rank))
                for n in frozen_shapes:
                    frozen_parts[n].append(frags[n].reshape(-1))
            elif rank > 0:
                self.model_states_path(rank)  # a missing file is an error even when nothing is read from it
            path = self.optim_path(rank)
            osd = _need(load_deepspeed_file(path), "optimizer_state_dict", path)
            groups = [t.reshape(-1) for t in _need(osd, "fp32_flat_groups", path)]
            flat = torch.cat(groups) if len(groups) != 1 else groups[0]
            base = _need(osd, "optimizer_state_dict", path)
            if rank == 0:
                self._groups_hyper(base)
                self._scaler(osd.get("loss_scaler"))
            sub_states = _flat_states(base, len(groups), path)
            merged = {}
            for k in sub_states[0] if sub_states else {}:
                vals = [s[k] for s in sub_states]
                merged[k] = vals[0] if vals[0].dim() == 0 else torch.cat([v.reshape(-1) for v in vals])
            local = 0
            for name, shape in shapes.items():
                n = _numel(shape)
                pn = math.ceil(n / self.world)
                lo, hi = min(rank * pn, n), min((rank + 1) * pn, n)
                if local + (hi - lo) > flat.numel():
                    raise DeepSpeedLayoutError(f"{path}: field 'fp32_flat_groups' holds {flat.numel()} elements, "
                                               f"fewer than 'param_shapes' need at {self.world} ranks")
                if lo < hi:
                    piece = flat[local:local + hi - lo]
                    full[name][lo:hi] = piece
                    self.out.fragment(rank, name, shape, lo, hi, piece,
                                      _split_states(merged, local, local + hi - lo, f"{path}"))
                local += pn
            if local != flat.numel():
                raise DeepSpeedLayoutError(f"{path}: field 'fp32_flat_groups' holds {flat.numel()} elements, "
                                           f"'param_shapes' at {self.world} ranks account for {local}")
            self.out.flush()
        for name, shape in shapes.items():  # ZeRO-3's module holds empty placeholders
            self.module[name] = full[name].view(*[int(d) for d in shape])
        for name, shape in frozen_shapes.items():
            dtype = self.module[name].dtype if name in self.module else torch.float32
            self.module[name] = torch.cat(frozen_parts[name])[:_numel(shape)].view(*[int(d) for d in shape]).to(dtype)
        self.trainable = list(shapes)

    def _read_universal(self) -> None:
        """DeepSpeed's universal checkpoint (``ds_to_universal.py``): ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``
        hold each parameter whole, ``zero/optimizer_state.pt`` the param groups and loss scaler."""
        zdir = self.folder / "zero"
        osd = load_deepspeed_file(zdir / "optimizer_state.pt")
        if not isinstance(osd, dict):
            raise DeepSpeedLayoutError(f"{zdir / 'optimizer_state.pt'}: expected a dict, found {type(osd).__name__}")
        stage = osd.get("zero_stage", self.stage)
        self.stage = int(getattr(stage, "value", stage))
        self._groups_hyper(osd)
        self._scaler(osd.get("loss_scaler"))
        shapes = {k: v for g in self.param_shapes for k, v in g.items()}
        if not shapes:
            raise DeepSpeedLayoutError(f"{self.ms_path}: field 'param_shapes' missing or empty")
        frozen = dict(self.ms.get("frozen_param_shapes") or {})
        step = _saved_step(osd)  # ZeRO-3's universal folders have no step.pt
        for name, shape in {**shapes, **frozen}.items():
            if name in frozen and not (zdir / name / "fp32.pt").is_file():  # ZeRO-3: the ranks' fragments
                ranks = [self.ms] + [load_deepspeed_file(self.model_states_path(r)) for r in range(1, self.world)]
                master = torch.cat([_need(ms, "frozen_param_fragments", self.folder)[name].reshape(-1)
                                    for ms in ranks])[:_numel(shape)]
            else:
                master = _universal_tensor(zdir / name / "fp32.pt", shape)
            dtype = self.module[name].dtype if name in self.module else torch.float32
            self.module[name] = master.view(*[int(d) for d in shape]).to(dtype)  # (ZeRO-3: placeholders there)
            if name in frozen:
                continue
            states = {k: _universal_tensor(zdir / name / f"{k}.pt", shape) for k in ("exp_avg", "exp_avg_sq")
                      if (zdir / name / f"{k}.pt").is_file()}
            if (zdir / name / "step.pt").is_file():
                states["step"] = load_deepspeed_file(zdir / name / "step.pt")
            elif states and step is not None:
                states["step"] = step
            self.out.fragment(0, name, shape, 0, _numel(shape), master,
                              _split_states(states, 0, _numel(shape), f"{zdir / name}"))
        self.world = 1  # every parameter whole, as one rank's
        self.trainable = list(shapes)

    def _read_stage0(self, opt, *, params: list[str] | None = None) -> None:
        """No ZeRO: the optimizer's state_dict is inside the model states; it names no parameters, so they
        are matched to the module's parameters in order (``params``: a pipeline stage's first candidates)."""
        self.trainable = []
        if opt is None:
            return
        where = f"{self.ms_path} field 'optimizer'"
        stage_params = params
        params = self._stage0_names() if params is None else params
        if "optimizer_state_dict" in opt:  # FP16_Optimizer / FP16_UnfusedOptimizer (fp16 and bf16)
            inner = opt["optimizer_state_dict"]
            self._scaler(opt)
        else:
            inner = opt
        groups = _need(inner, "param_groups", where)
        state = _need(inner, "state", where)
        self._groups_hyper(inner)
        ids = [i for g in groups for i in g["params"]]
        if "fp32_groups_flat" in opt:  # one flat fp32 tensor per group
            flats = [t.reshape(-1) for t in opt["fp32_groups_flat"]]
            names = self._match_names(params, [f.numel() for f in flats], per_group=True, where=where)
            for g, (flat, gnames) in enumerate(zip(flats, names)):
                off = 0
                for name in gnames:
                    n = self.module[name].numel()
                    self.out.fragment(0, name, self.module[name].shape, 0, n, flat[off:off + n],
                                      _split_states(dict(state.get(ids[g], {})), off, off + n, where))
                    off += n
                self.trainable += gnames
            return
        masters = [t for g in opt["fp32_groups"] for t in g] if "fp32_groups" in opt else None
        if stage_params is not None:
            params = params[:len(ids)]
        names = self._match_names(params, len(ids), per_group=False, where=where)
        for k, (i, name) in enumerate(zip(ids, names)):
            n = self.module[name].numel()
            sizes = {key: v.numel() for key, v in dict(state.get(i, {})).items()
                     if isinstance(v, torch.Tensor) and v.dim() > 0}
            if any(size != n for size in sizes.values()):
                raise DeepSpeedLayoutError(f"{where}: the state of optimizer parameter {k} has {sizes} elements, "
                                           f"parameter {name} (matched in order) {n}; frozen parameters among the "
                                           "trainable ones cannot be told apart here")
            master = masters[k].reshape(-1) if masters is not None else None
            if master is not None and master.numel() != n:
                raise DeepSpeedLayoutError(f"{where}: 'fp32_groups' entry {k} has {master.numel()} elements, "
                                           f"parameter {name} {n}")
            self.out.fragment(0, name, self.module[name].shape, 0, n, master,
                              _split_states(dict(state.get(i, {})), 0, n, where))
        self.trainable = names

    def _stage0_names(self) -> list[str]:
        """The module's parameters in order, tied names (the same tensor twice in 'module') once."""
        first: dict[tuple, str] = {}
        for k, v in self.module.items():
            if k in self.buffers or v.numel() == 0:
                continue
            owner = first.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), k)
            if owner != k:
                self.aliases[k] = owner
        if self.param_names is not None:
            return [n for n in self.param_names if n in self.module and n not in self.aliases]
        return [k for k in first.values()]

    def _match_names(self, params: list[str], sizes, *, per_group: bool, where: str):
        if not per_group:
            if len(params) != sizes:
                raise DeepSpeedLayoutError(
                    f"{where}: the optimizer holds {sizes} parameters, the module {len(params)} "
                    f"({', '.join(params[:8])}...); DeepSpeed stores no parameter names at ZeRO-0, so they are "
                    "matched by order. Load it with the engine of the model that trained it (its trainable "
                    "parameters are used), or with load_optimizer_states=False")
            return params
        out, k = [], 0
        for size in sizes:
            group, total = [], 0
            while total < size and k < len(params):
                group.append(params[k])
                total += self.module[params[k]].numel()
                k += 1
            if total != size:
                raise DeepSpeedLayoutError(f"{where}: field 'fp32_groups_flat' has a group of {size} elements that the "
                                           "module's parameters, taken in order, do not add up to")
            out.append(group)
        return out

    # -- the native checkpoint ---------------------------------------------------------------
    def manifest(self, tag: str) -> dict:
        ms, cfg = self.ms, self.cfg
        canonical = {k: v for k, v in self.module.items() if k not in self.aliases}
        dtype = next((v.dtype for k, v in canonical.items() if k in self.trainable), torch.float32)
        frozen = sorted(set(ms.get("frozen_param_shapes") or {}) |
                        ({k for k in canonical if k not in self.buffers and k not in self.trainable}
                         if self.stage > 0 else set()))
        gas = int(cfg.get("gradient_accumulation_steps") or 1)
        client = {k: v for k, v in ms.items() if k not in DEEPSPEED_KEYS}
        self.sched_json, sched_tensors = split_state(ms.get("lr_scheduler"), "scheduler")
        self.client_json, client_tensors = split_state(client, "client")
        self.extra = {**sched_tensors, **client_tensors}
        self.canonical = canonical
        groups = None
        if self.param_groups is not None:
            groups = [split_state(g, f"group{i}")[0] for i, g in enumerate(self.param_groups)]
        tensors = {"model": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                                 "fragments": [{"file": "model.safetensors", "key": k, "start": 0, "end": v.numel()}]}
                             for k, v in canonical.items()}}
        tensors.update(index_fragments(self.out.descs))
        return {
            "format": FORMAT, "version": VERSION, "shardwise_version": __version__, "tag": tag,
            "tensors": tensors, "aliases": self.aliases, "module_keys": list(self.module), "frozen": frozen,
            "topology": {"world_size": self.total_ranks, "dp_world_size": self.world, "zero_stage": self.stage},
            "engine": {"global_steps": int(ms["global_steps"]),
                       "global_samples": int(ms.get("global_samples", 0) or 0),
                       "micro_steps": int(ms["global_steps"]) * gas,
                       "skipped_steps": int(ms.get("skipped_steps", 0) or 0),
                       "loss_scaler": self.loss_scaler,
                       "param_dtype": str(dtype).removeprefix("torch."), "data": None},
            "optimizer": {"param_groups": groups} if groups is not None else None,
            "lr_scheduler": self.sched_json, "client_state": self.client_json,
            "config": json.loads(json.dumps(cfg, default=repr)),
            "rank_states": False,  # DeepSpeed saves no RNG states: no rank<r>.json/.safetensors
            "converted_from": {"deepspeed_version": str(ms.get("ds_version", "unknown")), "folder": str(self.folder)},
        }
