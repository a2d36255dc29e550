"""Master weights and optimizer state as (parameter name, flat range) fragments.

Each rank saves the fragments it owns (stage 0: rank 0 saves everything) to
``master_rank<r>.safetensors`` / ``optim_rank<r>.safetensors`` as 1-D tensors
keyed ``<name>@<start>:<end>[/<state>]``.  The manifest lists, per parameter
(and per optimizer state), every fragment with its file and range.  On load a
rank asks for exactly the ranges it owns *now* and they are cut out of
whatever fragments overlap them, so the world size and ZeRO stage may differ
between save and load.
"""

from __future__ import annotations

import contextlib

import torch
from safetensors import safe_open

from shardwise.checkpoint import tensor_parallel as tpc
from shardwise.zero.partitioned_param import full_shape


def rank_fragment_files(engine, rank: int):
    """Yield ``(file, tensors, descriptors)`` for this rank's fragments, one master and one optimizer
    file per resident batch (a single batch unless the optimizer is offloaded to NVMe, whose
    sub-groups are resident one at a time: write or copy the tensors before asking for the next).
    Stage 0 keeps everything on every data-parallel rank, so only data rank 0 writes. With tensor
    parallelism, tensor-sharded parameters are described in full-tensor coordinates
    (``checkpoint/tensor_parallel.py``) and replicated ones are written by tensor rank 0 only."""
    strategy = engine.strategy
    tp = tpc.view_of(engine)
    grid = getattr(engine, "grid", None)
    dp_rank = grid.get_data_parallel_rank() if grid is not None else rank
    regather = {}  # d != 0 pieces under partitioned stages: gathered over the data group below
    if tp.active and not strategy.replicated:
        regather = {n: d for n, d in tp.partition_dims.items() if d != 0 or n in tp.strides}
    saved_here = getattr(strategy, "saved_here", None)  # expert parallelism: one writer per expert's replicas
    if saved_here is None and strategy.replicated and dp_rank != 0:
        return
    shapes = {n: list(full_shape(p)) for n, p in engine.module.named_parameters()}
    for local, name in getattr(strategy, "saved_names", {}).items():  # experts under their global index
        shapes[name] = shapes.get(local)
    opt = engine.optimizer
    for k, batch in enumerate(strategy.fragment_batches()):
        suffix = f"rank{rank}" if k == 0 else f"rank{rank}_{k}"
        mfile, ofile = f"master_{suffix}.safetensors", f"optim_{suffix}.safetensors"
        master, optim, mdescs, odescs = {}, {}, [], []
        for name, start, end, t in batch:
            if saved_here is not None and not saved_here(name):
                continue
            dim = tp.partition_dims.get(name)
            if (dim is None and tp.rank != 0) or name in regather:
                continue
            if dim is not None and (strategy.replicated or dim != 0 or name in tp.strides):
                # a whole piece in its local shape (stage 0): one run of the saved layout per stride
                _add_piece(engine, tp, name, dim, shapes[name], t, master, optim, mdescs, odescs, mfile, ofile)
                continue
            base = {"name": name, "shape": shapes[name], "start": start, "end": end}
            if dim is not None:  # cut along dimension 0, stride 1: the fragment maps one to one
                n = _numel(shapes[name])
                base = {"name": name, "shape": tpc.full_shape_of(shapes[name], dim, tp.size), "partition_dim": dim,
                        "start": tp.rank * n + start, "end": tp.rank * n + end}
            key = f"{name}@{base['start']}:{base['end']}"
            if engine.precision.master_weights:
                master[key] = t.detach().reshape(-1)
                mdescs.append({**base, "kind": "master", "file": mfile, "key": key, "dtype": "float32"})
            for state_key, value in (opt.state.get(t, {}) if opt is not None else {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state '{state_key}' of {name} is a {type(value).__name__}, "
                                    "not a tensor")
                skey = f"{key}/{state_key}"
                scalar = value.shape != t.shape  # e.g. Adam's 0-d "step" (even for a 1-element fragment)
                optim[skey] = value.detach() if scalar else value.detach().reshape(-1)
                odescs.append({**base, "kind": "optim", "state": state_key, "scalar": scalar, "file": ofile,
                               "key": skey, "dtype": str(value.dtype).removeprefix("torch.")})
        if master:
            yield mfile, master, mdescs
        if optim:
            yield ofile, optim, odescs
    if regather:
        yield from _regathered_pieces(engine, rank, dp_rank, tp, regather, shapes)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _add_piece(engine, tp, name, dim, shape, piece, master, optim, mdescs, odescs, mfile, ofile, *,
               states=None, scalars=None) -> None:
    """Describe one whole tensor-parallel piece (and its optimizer state) as runs of the saved layout.
    ``states``: ``{state: whole piece}`` (default: the optimizer's state of ``piece``)."""
    stride = tp.strides.get(name, 1)
    full = tpc.full_shape_of(shape, dim, tp.size)
    if states is None:
        states, scalars = {}, {}
        opt = engine.optimizer
        for k, v in (opt.state.get(piece, {}) if opt is not None else {}).items():
            (scalars if v.shape != piece.shape else states)[k] = v.detach()
    runs = tpc.piece_runs(piece.detach().reshape(shape), dim, stride, tp.size, tp.rank)
    state_runs = {k: tpc.piece_runs(v.reshape(shape), dim, stride, tp.size, tp.rank) for k, v in states.items()}
    for j, (start, end, data) in enumerate(runs):
        base = {"name": name, "shape": full, "partition_dim": dim, "start": start, "end": end}
        key = f"{name}@{start}:{end}"
        if engine.precision.master_weights:
            master[key] = data
            mdescs.append({**base, "kind": "master", "file": mfile, "key": key, "dtype": "float32"})
        for k, sruns in state_runs.items():
            optim[f"{key}/{k}"] = sruns[j][2]
            odescs.append({**base, "kind": "optim", "state": k, "scalar": False, "file": ofile,
                           "key": f"{key}/{k}", "dtype": str(sruns[j][2].dtype).removeprefix("torch.")})
        for k, v in (scalars or {}).items():
            optim[f"{key}/{k}"] = v
            odescs.append({**base, "kind": "optim", "state": k, "scalar": True, "file": ofile,
                           "key": f"{key}/{k}", "dtype": str(v.dtype).removeprefix("torch.")})


def _regathered_pieces(engine, rank, dp_rank, tp, dims: dict[str, int], shapes: dict):
    """Partitioned stages, pieces cut along a dimension other than 0 or strided: gather each piece over
    the data group (every data rank takes part) and let data rank 0 write it whole in the saved layout."""
    strategy, opt = engine.strategy, engine.optimizer
    local_states, scalars = set(), {}
    for batch in strategy.fragment_batches():
        for _, _, _, t in batch:
            for k, v in (opt.state.get(t, {}) if opt is not None else {}).items():
                if v.shape != t.shape:
                    scalars.setdefault(k, v.detach())  # e.g. Adam's step: the same for every parameter
                else:
                    local_states.add(k)
    state_names = tpc.world_union(local_states)
    mfile, ofile = f"master_tp_rank{rank}.safetensors", f"optim_tp_rank{rank}.safetensors"
    master, optim, mdescs, odescs = {}, {}, [], []
    for name, dim in dims.items():
        shape = shapes[name]
        piece = tpc.gather_piece(strategy, name, shape, "param")
        states = {k: tpc.gather_piece(strategy, name, shape, k) for k in state_names}
        _add_piece(engine, tp, name, dim, shape, piece, master, optim, mdescs, odescs, mfile, ofile,
                   states=states, scalars=scalars)
    if dp_rank != 0:
        return
    if master:
        yield mfile, master, mdescs
    if optim:
        yield ofile, optim, odescs


def index_fragments(descs: list[dict]) -> dict:
    """Manifest section: ``{"master": {name: entry}, "optim": {"name/state": entry}}``."""
    out: dict[str, dict] = {"master": {}, "optim": {}}
    for d in descs:
        name = d["name"] if d["kind"] == "master" else f"{d['name']}/{d['state']}"
        entry = out[d["kind"]].setdefault(name, {"shape": d["shape"], "dtype": d["dtype"], "fragments": []})
        if "partition_dim" in d:  # tensor-sharded: fragments index the dimension-first layout
            entry["partition_dim"] = d["partition_dim"]
        if d.get("scalar"):
            entry["scalar"] = True
        entry["fragments"].append({"file": d["file"], "key": d["key"], "start": d["start"], "end": d["end"]})
    return out


class FragmentReader:
    """Reads flat ranges of named tensors out of a checkpoint, verifying each file once."""

    def __init__(self, ckpt, *, keep_open: bool = True) -> None:
        self.ckpt = ckpt  # a shardwise.checkpoint.manifest.Checkpoint
        self.keep_open = keep_open  # False: map a file only while reading from it (bounded memory)
        self._handles: dict[str, object] = {}

    @contextlib.contextmanager
    def open(self, file: str):
        if not self.keep_open:
            with safe_open(str(self.ckpt.check(file)), framework="pt") as fh:
                yield fh
            return
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.ckpt.check(file)), framework="pt")
        yield self._handles[file]

    def close(self) -> None:
        self._handles.clear()

    def read_range(self, entry: dict, start: int, end: int, *, what: str) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor described by a manifest ``entry``."""
        if entry.get("scalar"):
            f = entry["fragments"][0]
            with self.open(f["file"]) as fh:
                return fh.get_tensor(f["key"])
        out = None
        covered = 0
        for f in entry["fragments"]:
            lo, hi = max(start, f["start"]), min(end, f["end"])
            if lo >= hi:
                continue
            with self.open(f["file"]) as fh:
                piece = fh.get_slice(f["key"])[lo - f["start"] : hi - f["start"]]
            if lo == start and hi == end:
                return piece  # one fragment covers it all: no second buffer
            if out is None:
                out = torch.empty(end - start, dtype=piece.dtype)
            out[lo - start : hi - start] = piece
            covered += hi - lo
        if covered != end - start:
            raise ValueError(f"checkpoint has only {covered} of the {end - start} elements [{start}, {end}) of {what}")
        return out


def load_fragments(engine, reader: FragmentReader, manifest: dict, model_state: dict, *, load_optimizer: bool) -> None:
    """Fill this rank's fp32 weights and optimizer state from the checkpoint."""
    saved = manifest["tensors"]
    masters, optim = saved.get("master", {}), saved.get("optim", {})
    states_of: dict[str, list[str]] = {}
    for key in optim:
        name, state = key.rsplit("/", 1)
        states_of.setdefault(name, []).append(state)
    opt = engine.optimizer
    tp = tpc.view_of(engine)
    local_shapes = {n: list(full_shape(p)) for n, p in engine.module.named_parameters()}

    def read(entry, name, start, end, what):
        return tpc.read_local(reader, entry, name, local_shapes.get(name, entry["shape"]), start, end, tp, what=what)

    fragments = (x for batch in engine.strategy.fragment_batches() for x in batch)
    with torch.no_grad():
        for name, start, end, t in fragments:
            if name in masters:
                value = read(masters[name], name, start, end, f"master weights of {name}")
            elif name in model_state:
                value = model_state[name].reshape(-1)[start:end]
            else:
                continue  # not in the checkpoint (load_module_strict=False): keeps its current value
            t.view(-1).copy_(value)
            if not load_optimizer or opt is None:
                continue
            state = {}
            for state_key in states_of.get(name, []):
                entry = optim[f"{name}/{state_key}"]
                v = reader.read_range(entry, start, end, what="") if entry.get("scalar") else \
                    read(entry, name, start, end, f"optimizer state '{state_key}' of {name}")
                state[state_key] = v if entry.get("scalar") else v.view(t.shape)
            for k, v in state.items():  # in place where the state exists (it may live in an NVMe buffer)
                current = opt.state[t].get(k)
                if current is not None and current.shape == v.shape and k != "step":
                    current.copy_(v)
                else:
                    opt.state[t][k] = v.to(t.device) if k != "step" else v.clone()
