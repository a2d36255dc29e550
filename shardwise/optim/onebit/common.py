"""What the three compressed-communication optimizers share.

* The process group and ``comm_backend_name`` check (:class:`CompressedComm`).
* The momentum exchange: all tensors of the optimizer concatenated into one flat fp32 buffer and
  sent through ``shardwise.comm.compressed_all_reduce`` (one all-to-all and one all-gather per step,
  whatever the number of parameters), with this rank's error-feedback buffers.
* ``needs_gradient_allreduce``: the ZeRO strategy asks it before each backward; once the optimizer
  exchanges compressed momentum itself, the full-precision gradient all-reduce is off (DeepSpeed's
  ``enable_backward_allreduce``; ``zero/compressed.py``).
* Per-rank state for checkpoints (``rank_state_dict`` / ``load_rank_state_dict``): the error
  buffers differ on every rank, so each rank saves its own; they only fit the same number of ranks.

State shared by all ranks (momentum, frozen variance, counters) lives in ``self.state[p]`` as
tensors, so the regular checkpoint fragments carry it and it reshards like Adam's.
"""

from __future__ import annotations

import torch

from shardwise.comm import compressed


def check_common_args(*, amsgrad: bool, cuda_aware: bool, name: str) -> None:
    if amsgrad:
        raise ValueError(f"amsgrad: {name} has no AMSGrad variant (DeepSpeed refuses it too)")
    if not isinstance(cuda_aware, bool):
        raise ValueError(f"cuda_aware: must be true or false, got {cuda_aware!r}")


def check_positive_int(value, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(value, where: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{where}: must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def mask_unseen(pairs) -> None:
    """Zero the exchanged value where the variance is exactly zero: a gradient never reached that element
    (a dead unit, an unused embedding row), so its true momentum is zero, but a sign cannot say zero
    and ``+-scale / eps`` would blow the weight up. DeepSpeed asks users for an ``exp_avg_mask`` for
    this; here the variance's zeros are the mask. ``pairs``: (exchanged tensor, variance)."""
    for value, variance in pairs:
        value.masked_fill_(variance == 0, 0.0)


class CompressedComm:
    """Mixin: the data-parallel group, the compressed exchange and its per-rank error buffers."""

    compressed_communication = True  # zero/factory.py then builds the compressed variant (zero/compressed.py)

    def _init_comm(self, comm_backend_name: str | None, cuda_aware: bool) -> None:
        self.comm_backend_name = comm_backend_name
        self.cuda_aware = cuda_aware  # accepted for DeepSpeed configs; only its MPI backend used it
        self._group = None
        self._bound = False
        self._errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.backend = compressed.check_backend(comm_backend_name, None)
        self.partitioned_exchange = None  # ZeRO stage 1's exchange (optim/onebit/zero1.py), once it exists

    # -- engine integration -------------------------------------------------------------------
    def bind_group(self, group) -> None:
        """Exchange over ``group`` (the engine's data-parallel group; default: the world)."""
        self._group = group
        self._bound = True
        self.backend = compressed.check_backend(self.comm_backend_name, group)

    def use_partitioned_exchange(self, exchange) -> None:
        """At ZeRO stage 1 the step after warm-up is ``exchange``'s (``zero1.Zero1Exchange``), which
        must rebuild its full tensors after a checkpoint load."""
        self.partitioned_exchange = exchange

    @property
    def world_size(self) -> int:
        from shardwise import comm

        return comm.get_world_size(self._group)

    @property
    def needs_gradient_allreduce(self) -> bool:
        """Whether the next backward must all-reduce gradients in full precision (the engine asks)."""
        raise NotImplementedError

    # -- the exchange ---------------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _steps_done(self) -> int:
        """Optimizer steps taken so far (the largest ``step`` in the state: a tensor that had no gradient
        for a while lags behind)."""
        return max((int(st["step"]) for st in self.state.values() if "step" in st), default=0)

    def _exchange(self, key: str, tensors: list[torch.Tensor]) -> None:
        """Replace ``tensors`` (in place) by their compressed average over the group."""
        if self.world_size == 1 or not tensors:
            return
        sizes = [t.numel() for t in tensors]
        flat = self._flat(key, sum(sizes), tensors[0].device)
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
        self._exchange_flat(key, flat, sizes)
        with torch.no_grad():
            for t, piece in zip(tensors, flat.split(sizes)):
                t.copy_(piece.view(t.shape))

    def _flat(self, key: str, numel: int, device) -> torch.Tensor:
        """A reusable fp32 buffer of ``numel`` elements for the exchange ``key``."""
        flats = self.__dict__.setdefault("_flats", {})
        buf = flats.get(key)
        if buf is None or buf.numel() != numel or buf.device != torch.device(device):
            buf = flats[key] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

    def _exchange_flat(self, key: str, flat: torch.Tensor, sizes: list[int]) -> None:
        """Average ``flat`` (tensors of ``sizes`` end to end) over the group, 1-bit compressed, in place."""
        n = self.world_size
        if n == 1:
            return
        if key not in self._errors:
            self._errors[key] = compressed.error_buffers(flat.numel(), n, device=flat.device)
        worker, server = self._errors[key]
        compressed.compressed_all_reduce(flat, worker, server, group=self._group, sizes=sizes)

    def reset_errors(self) -> None:
        for worker, server in self._errors.values():
            worker.zero_()
            server.zero_()

    # -- per-rank checkpoint state ------------------------------------------------------------------
    def rank_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's own state (error feedback, and whatever a subclass adds): ``{}`` in warm-up."""
        out = {}
        for key, (worker, server) in self._errors.items():
            out[f"{key}.worker_error"] = worker
            out[f"{key}.server_error"] = server
        return out

    def load_rank_state_dict(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Restore what :meth:`rank_state_dict` returned (``None``: the checkpoint had none: reset)."""
        self._errors = {}
        if self.partitioned_exchange is not None:  # ZeRO stage 1: full tensors come from the loaded fragments
            self.partitioned_exchange.stale()
        for name, t in (tensors or {}).items():
            key, _, kind = name.rpartition(".")
            if kind not in ("worker_error", "server_error"):
                continue
            worker, server = self._errors.get(key, (None, None))
            if kind == "worker_error":
                worker = t.clone()
            else:
                server = t.clone()
            self._errors[key] = (worker, server)
        broken = [k for k, (w, s) in self._errors.items() if w is None or s is None]
        if broken:
            raise ValueError(f"checkpoint per-rank optimizer state lacks half of the error buffers of {broken}")
