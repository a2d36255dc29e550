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

``algorithm: "local_sgd"`` / ``"diloco"`` (torchft's ``LocalSGD`` and ``DiLoCo``, for slow links between
replica groups): each group steps its optimizer alone on its own gradients; no quorum, no traffic between
groups in between. Every ``sync_every`` optimizer steps the groups synchronise: the quorum opens before
the forward of the step whose update ends the period (the state a recovering group takes is then the
whole state after the previous update), and right after that step's optimizer step (an optimizer
post-hook, before the strategy copies the stepped fp32 weights to the module's storage or all-gathers
them) torchft's code runs on the tensors the optimizer steps (this rank's fp32 weights or ZeRO fragment):
LocalSGD averages them over the groups in the quorum; DiLoCo averages the pseudo-gradients (weights at
the last synchronisation - weights now) and steps them with the outer optimizer. A synchronisation that
does not commit leaves LocalSGD's weights local and resets DiLoCo's to the last synchronised ones (the
inner steps since are lost); the step counters move on in both cases.
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
from shardwise.config import ConfigError

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
        self.algorithm = cfg.algorithm
        if self.algorithm != "ddp":
            _check_periodic_sync(engine, cfg)
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
        self._sync = None
        if self.algorithm == "ddp":
            engine.train_step.before_update = self.before_update
        else:
            self._sync = _PeriodicSync(self, engine, cfg)
        self.start_step()  # the first quorum: a late or restarted replica group takes a peer's state now
        # A job that starts: wait (up to quorum_timeout) until every replica group of the launch is in, so that
        # none begins alone because another started slower; after that, quorums go on with whoever is alive.
        deadline = time.monotonic() + cfg.quorum_timeout
        while (self.manager.current_step() == 0 and self.manager.num_participants() < self.num_replicas
               and time.monotonic() < deadline):
            time.sleep(0.2)
            self.start_step()
        if self._sync is not None and not self.recovered:
            # Close the start-up quorum with a commit: torchft's manager step becomes 1, else the first
            # synchronisation (also at manager step 0) would again make every group but one take the first
            # one's state, dropping their first period. (A recovered group keeps the quorum open: it is the
            # peers' synchronisation, which this group takes part in at its first step.) The allreduce first
            # is a barrier over the quorum: a group taking this one's state has fetched it before the commit
            # stops serving it (with ddp, the first step's gradient average is that barrier).
            self.manager.allreduce(torch.zeros(1, device=engine.device)).wait()
            self.manager.should_commit()
            self._quorum_open = False

    # -- the seams the engine calls ------------------------------------------------------------------
    def before_forward(self) -> None:
        """The engine's forward: open the step's quorum if it is not open yet (local_sgd / diloco: only
        before the step whose update ends a period)."""
        if self._sync is not None:
            if not self._quorum_open and self._sync.syncs_next_step():
                self.start_step()
            return
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


def _check_periodic_sync(engine, cfg) -> None:
    """The configurations local_sgd / diloco run on: one optimizer step per engine step, on the tensors
    the optimizer owns, and every replica group stepping at every step."""
    algo = f"fault_tolerance.algorithm {cfg.algorithm!r}"
    problems = []
    if engine.config.fp16.enabled:
        problems.append(f"{algo} with fp16.enabled: a step skipped on overflow in one replica group would put it "
                        "out of step with the others' synchronisations; use bf16 or fp32")
    zero = engine.config.zero_optimization
    for key in ("offload_optimizer", "offload_param"):
        block = getattr(zero, key, None)
        if block is not None and getattr(block, "device", "none") not in (None, "none"):
            problems.append(f"{algo} with zero_optimization.{key}.device {block.device!r}: not supported "
                            "(the offloaded step is not one optimizer step on resident tensors)")
    if problems:
        raise ConfigError(problems)


class _PeriodicSync:
    """torchft's LocalSGD or DiLoCo on the tensors this rank's optimizer steps, driven by the engine's
    steps: see the module docstring."""

    def __init__(self, ft: "FaultTolerance", engine, cfg) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.ft, self.cfg = ft, cfg
        optimizer = _stepped_optimizer(engine)
        tensors = [t for s in [engine.strategy, *getattr(engine.strategy, "strategies", ())]
                   for _, _, _, t in s.local_fragments()]
        if not tensors:
            raise FaultToleranceError(f"fault_tolerance.algorithm {cfg.algorithm!r}: this rank's optimizer steps no tensor")
        # torchft's classes read `named_parameters()` of modules: parameters sharing the optimizer's storage
        holders = [torch.nn.Parameter(t.detach(), requires_grad=True) for t in tensors]
        self.sync_every = int(cfg.sync_every)
        self.local_step = 0  # optimizer steps since the last synchronisation (carried to a recovering group)
        if cfg.algorithm == "local_sgd":
            self.delay = 0
            self.algo = LocalSGD(ft.manager, torch.nn.ParameterList(holders), optimizer, sync_every=self.sync_every)
        else:
            from shardwise.optim.factory import build_optimizer

            n = int(cfg.fragments)
            fragments = [torch.nn.ParameterList(holders[i * len(holders) // n:(i + 1) * len(holders) // n])
                         for i in range(n)]
            if any(len(f) == 0 for f in fragments):
                raise ConfigError(f"fault_tolerance.fragments: {n} fragments, but this rank's optimizer steps only "
                                  f"{len(holders)} tensor(s)")
            outer = []
            for f in fragments:
                try:
                    outer.append(build_optimizer(cfg.outer_optimizer.type, dict(cfg.outer_optimizer.params),
                                                 list(f.parameters())))
                except (ValueError, TypeError) as exc:
                    raise ConfigError(f"fault_tolerance.outer_optimizer: {exc}") from None
            self.delay = int(cfg.fragment_sync_delay)
            self.algo = DiLoCo(ft.manager, fragments, optimizer, outer, sync_every=self.sync_every,
                               pin_memory=False, fragment_sync_delay=self.delay,
                               fragment_update_alpha=float(cfg.fragment_update_alpha))
            self.period = self.sync_every // n  # torchft: one fragment every sync_every / fragments steps
        if cfg.algorithm == "local_sgd":
            self.period = self.sync_every
        ft.register_state("_shardwise_periodic_sync", lambda: {"local_step": self.local_step}, self._load)
        optimizer.register_step_pre_hook(self._pre_step)
        optimizer.register_step_post_hook(self._post_step)

    def _load(self, state: dict) -> None:
        self.local_step = int(state["local_step"])

    def syncs_next_step(self) -> bool:
        """Whether the coming optimizer step starts a synchronisation (its quorum opens before it)."""
        return self.local_step + 1 == self.period - self.delay

    def _pre_step(self, *_args) -> None:
        self.ft.manager.disallow_state_dict_read()  # (as torchft's hooks: no live state read mid-step)

    def _post_step(self, *_args) -> None:
        manager = self.ft.manager
        manager.allow_state_dict_read()
        self.local_step += 1
        if self.local_step == self.period - self.delay:
            if not self.ft._quorum_open:  # (a step taken outside the engine's forward)
                self.ft.start_step()
            self.ft._quorum_open = False
            self.ft.participants = manager.num_participants()
            if self.cfg.algorithm == "local_sgd":
                before = manager.current_step()
                self.algo._perform_sync()  # (torchft's LocalSGD.sync, less the quorum opened before the step)
                self._commit(manager.current_step() > before)
                self.local_step = 0
                return
            self.fragment = self.algo._current_fragment()
            self.algo._fragments[self.fragment].prepare_sync()
        if self.cfg.algorithm == "diloco" and self.local_step == self.period:
            self._commit(self.algo._fragments[self.fragment].perform_sync())
            self.local_step = 0

    def _commit(self, committed: bool) -> None:
        if not committed:
            self.ft.discarded_steps += 1
            logger.warning("replica group %d: the %s synchronisation at step %d did not commit (a replica group was "
                           "lost during it)", self.ft.replica_id, self.cfg.algorithm, self.ft.engine.global_steps)


def _stepped_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer the strategy calls ``step()`` on, once per engine step."""
    strategy = engine.strategy
    opt = getattr(getattr(strategy, "partition", None), "optimizer", None) or getattr(strategy, "optimizer", None)
    if not isinstance(opt, torch.optim.Optimizer):
        raise FaultToleranceError("fault_tolerance.algorithm local_sgd/diloco needs the engine's ZeRO strategy to step a "
                                  f"torch optimizer (got {type(opt).__name__})")
    return opt


def _accelerator_pg(timeout: timedelta):
    from torchft import ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout)


def attach(engine) -> "FaultTolerance":
    """Build the :class:`FaultTolerance` of ``engine`` and join the first quorum."""
    return FaultTolerance(engine)
