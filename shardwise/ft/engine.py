"""What an engine holds when ``fault_tolerance.enabled``: torchft's Manager, wired to the training step.

Per optimizer step (``algorithm: "ddp"``):

1. before the step's first forward (``before_forward``): the quorum of the replica groups alive now
   (torchft's ``Manager.start_quorum``, synchronous). The replica-axis process group is re-formed when
   the quorum changed; a replica group behind the others (joining, rejoining) takes a live peer's state
   here (``shardwise.ft.state``), before it computes anything;
2. forward and backward inside the replica group, as without fault tolerance (any ZeRO stage);
3. before the update (``before_update``, called by the training step): the gradients this rank holds
   (its ZeRO shard; the whole gradients at stage 0) averaged with the same shard of the other replica
   groups in the quorum, then torchft's commit vote (``should_commit``). Committed: the clipped optimizer
   step runs on the averaged gradients, identical on every replica group. Not committed (a replica group
   was lost during the step, or fewer than ``min_replicas`` took part): the step in flight is discarded
   on every replica group: gradients zeroed, no optimizer or scheduler step, the step counters do not
   move, and the batch each group drew for it is not trained on.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from datetime import timedelta

import torch

from shardwise import comm

from . import LIGHTHOUSE_ENV, FaultToleranceError, num_replica_groups, replica_group_id
from . import state as live_state

logger = logging.getLogger(__name__)


def _store_host() -> str:
    return os.environ.get("SHARDWISE_FT_HOST") or socket.gethostname()


class FaultTolerance:
    """torchft's Manager for one engine; see the module docstring for the step protocol."""

    def __init__(self, engine) -> None:
        from torchft import Manager, ProcessGroupGloo

        cfg = engine.config.fault_tolerance
        self.config = cfg
        self.engine = engine
        if engine.dims.pipe > 1:
            raise FaultToleranceError("fault_tolerance: pipeline parallelism inside a replica group is not supported yet")
        if getattr(engine, "has_moe_layers", False):
            raise FaultToleranceError("fault_tolerance: models with MoE layers are not supported yet")
        for s in [engine.strategy, *getattr(engine.strategy, "strategies", ())]:
            partition = getattr(s, "partition", None)
            if partition is not None and hasattr(partition, "overlap_step"):
                partition.overlap_step = False  # the update must wait for the replica-group average
        self.lighthouse = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not self.lighthouse:
            raise FaultToleranceError(
                f"fault_tolerance.enabled: no lighthouse address; launch with `shardwise run --ft_replicas R` "
                f"(or --ft_lighthouse HOST:PORT), set {LIGHTHOUSE_ENV}, or fault_tolerance.lighthouse")
        if "://" not in self.lighthouse:
            self.lighthouse = f"http://{self.lighthouse}"
        self.replica_id = replica_group_id()
        self.num_replicas = num_replica_groups()
        self._extra_state: dict[str, tuple] = {}
        self.recovered = False  # True once this replica group took a peer's state
        self.recovered_at_step: int | None = None
        self.discarded_steps = 0
        self.participants = 0  # replica groups in the last step's quorum
        self._quorum_open = False
        self._reshard_training_loader()

        # The group's own store (rank 0 hosts it): torchft's manager address, and the rendezvous of the
        # replica-axis process group. Fresh per start, so nothing a killed attempt left is read again.
        host = _store_host()
        self._store = None
        if comm.get_rank() == 0:
            self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        else:
            port = None
        port = comm.broadcast_object(port, src=0) if comm.get_world_size() > 1 else port
        timeout = timedelta(seconds=cfg.timeout)
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout) if engine.device.type == "cpu" else _accelerator_pg(timeout),
                load_state_dict=None, state_dict=None, min_replica_size=int(cfg.min_replicas),
                use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout),
                connect_timeout=timedelta(seconds=cfg.connect_timeout), rank=comm.get_rank(),
                world_size=comm.get_world_size(), store_addr=host, store_port=port,
                lighthouse_addr=self.lighthouse, replica_id=f"shardwise_replica_{self.replica_id}", hostname=host)
        except Exception as exc:
            raise FaultToleranceError(f"fault_tolerance: cannot reach the lighthouse at {self.lighthouse}: {exc}") from exc
        self.manager.register_state_dict_fn("shardwise", self._load_live_state, self._live_state)
        atexit.register(self.shutdown)
        engine.train_step.before_update = self.before_update
        self.start_step()  # the first quorum: a late or restarted replica group takes a peer's state now
        # A job that starts: wait (up to quorum_timeout) until every replica group of the launch is in, so that
        # none begins alone because another started slower; after that, quorums go on with whoever is alive.
        deadline = time.monotonic() + cfg.quorum_timeout
        while (self.manager.current_step() == 0 and self.manager.num_participants() < self.num_replicas
               and time.monotonic() < deadline):
            time.sleep(0.2)
            self.start_step()

    # -- the seams the engine calls ------------------------------------------------------------------
    def before_forward(self) -> None:
        """The engine's forward: open the step's quorum if it is not open yet."""
        if not self._quorum_open:
            self.start_step()

    def before_update(self) -> bool:
        """The training step, at the accumulation boundary: average the gradients over the replica groups
        in the quorum and vote. True: step the optimizer; False: discard the step (the caller zeroes the
        gradients and leaves the counters)."""
        if not self._quorum_open:  # backward ran without the engine's forward
            self.start_step()
        self._quorum_open = False
        self.participants = self.manager.num_participants()
        works = [self.manager.allreduce(g) for g in self._gradients()]
        for w in works:
            w.wait()
        try:
            committed = self.manager.should_commit()
        except Exception as exc:
            raise FaultToleranceError(f"fault_tolerance: the commit vote of step {self.engine.global_steps} failed: {exc}") from exc
        if not committed:
            self.discarded_steps += 1
            logger.warning("replica group %d: step %d discarded (a replica group was lost during it, or fewer than "
                           "fault_tolerance.min_replicas=%d took part)", self.replica_id, self.engine.global_steps,
                           self.config.min_replicas)
        return committed

    def start_step(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as exc:
            raise FaultToleranceError(
                f"fault_tolerance: replica group {self.replica_id} could not form a quorum with the lighthouse at "
                f"{self.lighthouse} (within fault_tolerance.quorum_timeout={self.config.quorum_timeout}s): {exc}") from exc
        self._quorum_open = True
        if err := self.manager.errored():
            logger.warning("replica group %d: quorum error, this step will be discarded: %s", self.replica_id, err)

    # -- live state ------------------------------------------------------------------------------------
    def register_state(self, key: str, state_dict, load_state_dict) -> None:
        """Carry more of the script's state to a recovering replica group: ``state_dict()`` is called on a
        healthy peer, ``load_state_dict(value)`` on the recovering group (e.g. the position of a data
        loader the script built itself)."""
        if key in self._extra_state:
            raise ValueError(f"fault_tolerance: state {key!r} is registered already")
        self._extra_state[key] = (state_dict, load_state_dict)

    def _live_state(self) -> dict:
        return live_state.capture(self.engine, {k: fn() for k, (fn, _) in self._extra_state.items()})

    def _load_live_state(self, state: dict) -> None:
        extra = live_state.restore(self.engine, state)
        for key, (_, load) in self._extra_state.items():
            if key in extra:
                load(extra[key])
        if self.engine.global_steps > 0:  # (at step 0 every group but one takes the first one's start weights)
            self.recovered = True
            self.recovered_at_step = self.engine.global_steps
        logger.warning("replica group %d: took the live state of a peer at step %d (no checkpoint read)",
                       self.replica_id, self.engine.global_steps)

    # -- helpers ------------------------------------------------------------------------------------
    def _gradients(self) -> list[torch.Tensor]:
        out = []
        for s in [self.engine.strategy, *getattr(self.engine.strategy, "strategies", ())]:
            if hasattr(s, "owned_grads"):
                out.extend(s.owned_grads())
            elif hasattr(s, "grad_buffers"):
                out.extend(s.grad_buffers)
        return out

    def _reshard_training_loader(self) -> None:
        """The engine's training loader: each replica group reads its own share (data rank r of group g
        reads share g * data_ranks + r of data_ranks * replica groups)."""
        engine = self.engine
        loader = engine.training_dataloader
        if loader is None or self.num_replicas == 1:
            return
        sampler = getattr(loader, "sampler", None)
        if sampler is None or not hasattr(sampler, "num_replicas"):
            return
        from shardwise.runtime.dataloader import build_dataloader

        engine.training_dataloader = build_dataloader(
            loader.dataset, batch_size=loader.batch_size, dp_world_size=engine.seq_dp_world_size * self.num_replicas,
            dp_rank=self.replica_id * engine.seq_dp_world_size + engine._seq_dp_rank(), collate_fn=loader.collate_fn,
            drop_last=loader.drop_last, num_workers=loader.num_workers, pin_memory=loader.pin_memory)

    def shutdown(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None:
            self.manager = None
            try:
                manager.shutdown(wait=False)
            except Exception:  # already down at interpreter exit
                pass


def _accelerator_pg(timeout: timedelta):
    from torchft import ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout)


def attach(engine) -> "FaultTolerance":
    """Build the :class:`FaultTolerance` of ``engine`` and join the first quorum."""
    return FaultTolerance(engine)
