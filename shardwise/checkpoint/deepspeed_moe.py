"""DeepSpeed's MoE checkpoints (``_save_moe_checkpoint`` of DeepSpeed 0.1x) as shardwise checkpoints.

A model with DeepSpeed-API ``MoE`` layers is saved by DeepSpeed as:

* ``mp_rank_00_model_states.pt``: the usual model states (``deepspeed_format.py``) with the expert weights
  taken out of ``module``, plus ``num_experts`` (one entry per MoE layer, in module order);
* ``layer_<L>_expert_<e>_mp_rank_00_model_states.pt`` per MoE layer L and global expert e: that expert's
  weights under their global names (local expert j of expert-parallel rank r is global expert
  ``r * local + j``, ``...deepspeed_moe.experts.deepspeed_experts.<e>.<name>``); DeepSpeed's oldest layout
  names them ``expert_<e>_mp_rank_00_model_states.pt``;
* without ZeRO, ``expp_rank_<r>_mp_rank_00_optim_states.pt`` per expert-parallel rank r: ``optimizer``,
  the torch state dict of that rank's optimizer (the dense parameters, the same on every rank, and its
  local experts; param groups as ``split_params_into_different_moe_groups_for_optimizer`` made them,
  the expert ones ``{"moe": True, "name": "ep_size_<N>"}``);
* with ZeRO 1-2, the ordinary ``zero_pp_rank_<d>_mp_rank_00_optim_states.pt`` per data-parallel rank d,
  whose expert param groups are partitioned over the expert-data-parallel group of d (the ranks holding
  the same experts: ``d % N`` is d's expert-parallel rank, ``d // N`` its place in that group; DeepSpeed's
  default layout) and name the parameters by their local index, as rank 0's ``param_shapes`` does.

Everything is renamed to global expert names, the universal layout of shardwise's own MoE checkpoints,
so the result loads at any ``ep_size`` and world size.  The reader is ``deepspeed_format._Reader`` with
the expert files added to the module and the optimizer read per expert-parallel rank.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from shardwise.checkpoint.deepspeed_format import DeepSpeedLayoutError, _need, _numel, _Reader, _split_states
from shardwise.checkpoint.safe_unpickle import load_deepspeed_file

logger = logging.getLogger("shardwise")

_EXPERT_FILE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EXPERT_KEY = re.compile(r"^(.*deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)\.(.+)$")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def is_moe_folder(folder: Path) -> bool:
    """Whether a DeepSpeed checkpoint folder holds MoE expert files."""
    return any(_EXPERT_FILE.match(p.name) for p in folder.iterdir())


class MoEReader(_Reader):
    def __init__(self, folder: Path, param_names: list[str] | None, tmp: Path) -> None:
        super().__init__(folder, param_names, tmp)
        if self.ms.get("ds_autoep_layers"):
            raise ValueError(f"{self.ms_path}: a DeepSpeed AutoEP checkpoint (field 'ds_autoep_layers'); shardwise "
                             "imports checkpoints of DeepSpeed's MoE layer only (deepspeed.moe.layer.MoE)")
        if self.cfg.get("use_data_before_expert_parallel_"):
            raise ValueError(f"{self.ms_path}: saved with use_data_before_expert_parallel_=true (expert-parallel "
                             "groups strided over the data ranks); shardwise reads DeepSpeed's default layout only")
        names = [p.name for p in folder.iterdir()]
        if not any(n.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) and "optim_states" in n for n in names):
            self.stage = 0  # (the base took the expp_rank_* optimizer files for ZeRO's)
        self.dense = [k for k in self.module if k not in self.buffers]  # mp_rank_00's module: no experts
        self.layers: dict[str, dict[int, list[str]]] = {}  # expert-list prefix -> global id -> its names
        self._read_expert_files(names)

    def _read_expert_files(self, names: list[str]) -> None:
        found: dict[int | None, set[int]] = {}
        for name in sorted(names, key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)]):
            m = _EXPERT_FILE.match(name)
            if not m:
                continue
            if int(m.group(3)) != 0:
                raise ValueError(f"{self.folder / name}: an expert file of tensor-parallel rank {int(m.group(3))}; "
                                 "shardwise reads DeepSpeed MoE checkpoints without tensor parallelism only")
            layer, expert = (int(m.group(1)) if m.group(1) else None), int(m.group(2))
            found.setdefault(layer, set()).add(expert)
            sd = load_deepspeed_file(self.folder / name)
            if not isinstance(sd, dict) or not sd:
                raise DeepSpeedLayoutError(f"{self.folder / name}: expected an expert's state dict, found "
                                           f"{type(sd).__name__ if not isinstance(sd, dict) else 'an empty dict'}")
            for key, value in sd.items():
                key = key.lstrip(".")  # (an MoE layer that is the model itself: DeepSpeed writes ".deepspeed_moe...")
                k = _EXPERT_KEY.match(key)
                if not k or int(k.group(2)) != expert or not isinstance(value, torch.Tensor):
                    raise DeepSpeedLayoutError(f"{self.folder / name}: key '{key}' is not a tensor of expert {expert} "
                                               "(...deepspeed_moe.experts.deepspeed_experts.<e>.<name>)")
                self.module[key] = value
                self.layers.setdefault(k.group(1), {}).setdefault(expert, []).append(k.group(3))
        counts = list(self.ms.get("num_experts") or [])
        for layer, count in enumerate(counts):
            missing = sorted(set(range(int(count))) - found.get(layer, set()))
            if missing and None not in found:
                raise FileNotFoundError(f"DeepSpeed MoE checkpoint {self.folder}: MoE layer {layer} has {count} "
                                        f"experts ('num_experts' of {self.ms_path.name}) but the files of experts "
                                        f"{missing} (layer_{layer}_expert_<e>_mp_rank_00_model_states.pt) are missing")

    # -- naming ------------------------------------------------------------------------------
    def _global(self, local_name: str, ep: int, ep_rank: int, where) -> str:
        """A local expert name of expert-parallel rank ``ep_rank`` (of ``ep``) as its global name."""
        m = _EXPERT_KEY.match(local_name)
        if m is None:
            raise DeepSpeedLayoutError(f"{where}: '{local_name}' is in an expert param group but not an expert "
                                       "parameter (...deepspeed_moe.experts.deepspeed_experts.<j>.<name>)")
        prefix, j = m.group(1), int(m.group(2))
        experts = self.layers.get(prefix)
        if not experts or len(experts) % ep:
            raise DeepSpeedLayoutError(f"{where}: expert group ep_size_{ep} holds '{local_name}', but the expert "
                                       f"files hold {len(experts or {})} experts of {prefix.rstrip('.')}, not a "
                                       f"multiple of {ep}")
        return f"{prefix}{ep_rank * (len(experts) // ep) + j}.{m.group(3)}"

    def _expert_names(self, ep: int, ep_rank: int) -> list[str]:
        """Expert-parallel rank ``ep_rank``'s expert parameters (global names) of the layers of ``ep`` ranks, in
        module order, as DeepSpeed's expert param group holds them."""
        out = []
        for prefix, experts in self.layers.items():
            local = len(experts) // ep
            for e in range(ep_rank * local, (ep_rank + 1) * local):
                out += [f"{prefix}{e}.{rest}" for rest in experts.get(e, [])]
        return out

    @staticmethod
    def _group_ep(group: dict, where) -> int:
        """1 for a dense param group, N for DeepSpeed's expert group ``ep_size_N``."""
        if not group.get("moe", False):
            return 1
        m = _GROUP_NAME.match(str(group.get("name")))
        if m is None:
            raise DeepSpeedLayoutError(f"{where}: an expert param group ('moe': True) named {group.get('name')!r}, "
                                       "not ep_size_<N>")
        return int(m.group(1))

    # -- optimizer state -----------------------------------------------------------------------
    def read(self) -> None:
        self.param_groups = None
        self.loss_scaler = None
        if (self.folder / "zero" / "optimizer_state.pt").is_file():
            raise ValueError(f"{self.folder}: a universal checkpoint of an MoE model; shardwise imports DeepSpeed's "
                             "MoE checkpoints as save_checkpoint writes them (import that one instead)")
        if self.stage == 0:
            self._read_expert_ranks()
        elif self.stage == 3:
            raise ValueError(f"{self.folder}: a ZeRO-3 checkpoint with DeepSpeed MoE expert files, which DeepSpeed "
                             "does not write (its MoE refuses ZeRO-3)")
        else:
            self._read_partitions()
        if self.param_groups is not None:  # the engine loading it keeps its own group names and expert flags
            self.param_groups = [{k: v for k, v in g.items() if k not in ("moe", "name")} for g in self.param_groups]
        self.out.flush()

    def _read_expert_ranks(self) -> None:
        """No ZeRO: one torch optimizer state dict per expert-parallel rank; its param ids are matched to the
        dense parameters (rank 0's file) and that rank's experts in order, checked by size."""
        files = {int(m.group(1)): p for p in self.folder.iterdir() if (m := _EXPP_OPTIM.match(p.name))}
        self.trainable = []
        if not files:
            return
        missing = sorted(set(range(max(files) + 1)) - set(files))
        if missing:
            raise FileNotFoundError(f"DeepSpeed MoE checkpoint {self.folder}: the optimizer files of expert-parallel "
                                    f"ranks {missing} (expp_rank_<r>_mp_rank_00_optim_states.pt) are missing")
        dense = [n for n in self.dense if self.param_names is None or n in self.param_names]
        for ep_rank, path in sorted(files.items()):
            opt = _need(load_deepspeed_file(path), "optimizer", path)
            if opt is None:
                return
            if "optimizer_state_dict" in opt:  # FP16_Optimizer / bf16 wrappers: not read here
                logger.warning("%s: the optimizer state of an fp16/bf16 ZeRO-0 MoE checkpoint is not imported "
                               "(weights, scheduler and counters are); the optimizer starts afresh", path)
                self.trainable, self.param_groups = [], None
                return
            state, groups = _need(opt, "state", path), _need(opt, "param_groups", path)
            if ep_rank == 0:
                self._groups_hyper(opt)
            queue = list(dense)
            for g, group in enumerate(groups):
                ep = self._group_ep(group, f"{path} param group {g}")
                if ep == 1 and ep_rank > 0:  # the dense states are every rank's: rank 0's are read
                    continue
                names = queue[:len(group["params"])] if ep == 1 else self._expert_names(ep, ep_rank)
                if ep == 1:
                    queue = queue[len(names):]
                if len(names) != len(group["params"]):
                    raise DeepSpeedLayoutError(f"{path}: param group {g} holds {len(group['params'])} parameters, "
                                               f"the model {len(names)} for it ({', '.join(names[:6])}...)")
                for i, name in zip(group["params"], names):
                    n = self.module[name].numel()
                    st = dict(state.get(i, {}))
                    sizes = {k: v.numel() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
                    if any(size != n for size in sizes.values()):
                        raise DeepSpeedLayoutError(f"{path}: the state of optimizer parameter {i} has {sizes} "
                                                   f"elements, parameter {name} (matched in order) {n}")
                    self.out.fragment(ep_rank, name, self.module[name].shape, 0, n, None,
                                      _split_states(st, 0, n, f"{path}"))
                    self.trainable.append(name)
            self.out.flush()

    def _read_partitions(self) -> None:
        """ZeRO 1-2: per data-parallel rank d and param group, d's slice of the group's flat buffer; a dense
        group's buffer spans all ranks, an expert group's (``ep_size_N``) the ranks d' with d' % N == d % N."""
        if not self.param_shapes:
            raise DeepSpeedLayoutError(f"{self.ms_path}: field 'param_shapes' missing or empty")
        starts: dict[tuple[int, int], int] = {}  # (group, expert-parallel rank) -> start of the next slice
        eps = []
        for rank in range(self.world):
            path = self.optim_path(rank)
            osd = _need(load_deepspeed_file(path), "optimizer_state_dict", path)
            parts = _need(osd, "single_partition_of_fp32_groups", path)
            base = _need(osd, "base_optimizer_state", path)
            groups = _need(base, "param_groups", path) if isinstance(base, dict) else None
            if len(parts) != len(self.param_shapes) or groups is None or len(groups) != len(parts):
                raise DeepSpeedLayoutError(f"{path}: {len(parts)} flat groups and "
                                           f"{len(groups) if groups is not None else 'no'} param groups (field "
                                           f"'base_optimizer_state'), 'param_shapes' of {self.ms_path.name} "
                                           f"{len(self.param_shapes)}")
            if "zero_stage" in osd:
                stage = osd["zero_stage"]
                self.stage = int(getattr(stage, "value", stage))
            eps = [self._group_ep(grp, f"{path} param group {g}") for g, grp in enumerate(groups)]
            counts = osd.get("partition_count")
            for g, ep in enumerate(eps):
                if self.world % ep or (isinstance(counts, list) and int(counts[g]) != self.world // ep):
                    raise DeepSpeedLayoutError(f"{path}: param group {g} (ep_size {ep}) has field 'partition_count' "
                                               f"{counts[g] if isinstance(counts, list) else counts}, expected "
                                               f"dp_world_size / ep_size = {self.world} / {ep}")
            states, align, mappings = self._partition_states(osd, base, len(parts), path, rank)
            for g, (shapes, part) in enumerate(zip(self.param_shapes, parts)):
                ep_rank = rank % eps[g]
                part = part.reshape(-1)
                lo_r = starts.get((g, ep_rank), 0)
                hi_r = lo_r + part.numel()
                off, seen = 0, {}
                for j, (local, shape) in enumerate(shapes.items()):
                    name = local if eps[g] == 1 else self._global(local, eps[g], ep_rank, f"{path} group {g}")
                    n = _numel(shape)
                    lo, hi = max(off, lo_r), min(off + n, hi_r)
                    if lo < hi:
                        self.out.fragment(rank, name, shape, lo - off, hi - off, part[lo - lo_r:hi - lo_r],
                                          _split_states(states[g], lo - lo_r, hi - lo_r, f"{path} group {g}"))
                        seen[local] = (hi - lo, lo - lo_r)
                    off += n + (int(align[g][j]) if align else 0)
                if mappings is not None and g < len(mappings):
                    saved = {k: (int(v.numel), int(v.start)) for k, v in mappings[g].items()}
                    if saved != seen:
                        raise DeepSpeedLayoutError(f"{path}: field 'param_slice_mappings' of group {g} does not match "
                                                   f"the layout derived from 'param_shapes' (saved {saved}, derived "
                                                   f"{seen})")
                starts[(g, ep_rank)] = hi_r
            self.out.flush()
        self.trainable = []
        for g, shapes in enumerate(self.param_shapes):
            need = sum(_numel(s) for s in shapes.values())
            for ep_rank in range(eps[g]):
                if starts.get((g, ep_rank), 0) < need:
                    raise DeepSpeedLayoutError(f"{self.folder}: the partitions of param group {g} (expert-parallel "
                                               f"rank {ep_rank}) hold {starts.get((g, ep_rank), 0)} elements over "
                                               f"their ranks, 'param_shapes' need {need}")
                self.trainable += [n if eps[g] == 1 else self._global(n, eps[g], ep_rank, self.ms_path) for n in shapes]
