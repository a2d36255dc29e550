"""``PipelineEngine``: trains a ``PipelineModule`` one batch at a time with ``train_batch()``.

A sibling of ``Engine`` over the same base (``EngineBase`` in ``runtime/engine.py``: the parts ``parallelize``
builds, the ZeRO strategy over this stage's data-parallel group, optimizer, scheduler, counters,
checkpoints). Where ``Engine`` drives the one ``TrainingStep`` (``runtime/train_step.py``) from the user's
forward/backward/step calls, this file drives it from a pipeline schedule: one batch is
``gradient_accumulation_steps`` micro-batches; the schedule (``schedule.py``) says in which order this
stage runs their forward and backward passes and where activations and gradients cross to the
neighbouring stages (``p2p.py``). The accumulation boundary is the stage's last backward of the batch:
the ZeRO strategy launches the data-parallel reduction while it runs, and ``ReduceGrads`` waits for it
after the input gradients have gone upstream; ``OptimizerStep`` is the training step's ``batch_step``.

Train and eval losses are reduced by the same ``_replica_mean``. The gradient norm (clipping, the fp16
overflow check) is taken over every stage, so all stages clip by the same coefficient and skip together;
tied layers' gradients are summed over the stages holding them first.
"""

from __future__ import annotations

import logging
import torch

from shardwise import checkpointing, comm
from shardwise.comm.p2p import WIRE_DTYPES, ActivationReceiver, ActivationSender, GradSender, recv_grads
from shardwise.pipe import schedule as sched
from shardwise.pipe.module import PipelineError, PipelineModule
from shardwise.runtime import autocast as torch_autocast
from shardwise.runtime.dataloader import RepeatingLoader
from shardwise.runtime.engine import Engine, EngineBase

logger = logging.getLogger("shardwise")

_ONLY_TRAIN_BATCH = ("engine.{}() is not available on a pipeline engine: the pipeline runs forward, backward "
                     "and step itself. Call loss = engine.train_batch(data_iter) once per batch "
                     "(engine.eval_batch(data_iter) to evaluate)")


def as_tensors(value, where) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, single)``; anything but a tensor or a tuple/list of tensors of a wire dtype is refused naming
    ``where`` (a string, or a function returning it, called only then)."""
    if isinstance(value, torch.Tensor):
        tensors, single = (value,), True
    elif isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        tensors, single = tuple(value), False
    else:
        tensors = None
    if tensors is not None:
        bad = [t.dtype for t in tensors if t.dtype not in WIRE_DTYPES]
        if not bad:
            return tensors, single
    if callable(where):
        where = where()
    if tensors is not None:
        raise PipelineError(f"{where} returned a tensor of dtype {bad[0]}, which cannot be sent between pipeline "
                            f"stages (one of {', '.join(str(d) for d in WIRE_DTYPES)})")
    kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else \
        f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    raise PipelineError(f"{where} returned a {kinds}: the output of a pipeline stage must be a tensor or a "
                        "tuple of tensors (it is sent to the next stage)")


def grad_slots(tensors) -> list[int]:
    """Indices of the tensors that carry a gradient back (the floating-point ones)."""
    return [i for i, t in enumerate(tensors) if t.is_floating_point()]


class PipelineEngine(EngineBase):
    """DeepSpeed's ``PipelineEngine``: what ``initialize`` returns for a ``PipelineModule``."""

    _pipeline = True

    def __init__(self, *, model: PipelineModule, config, grid=None, **kwargs) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine needs a shardwise.pipe.PipelineModule, got {type(model).__name__}")
        grid = model.mpu() if grid is None else grid  # (initialize passes the grid it planned)
        super().__init__(model=model, config=config, grid=grid, **kwargs)
        if config.pipeline.use_reentrant is False:  # whatever the interval: set_checkpoint_interval may enable it
            model.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
        interval = int(config.pipeline.activation_checkpoint_interval)
        if interval > 0:  # as DeepSpeed: the config's interval, when set, replaces the module's
            model.activation_checkpoint_interval = interval
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self._last_vs = model.num_stages * model.virtual_stages - 1  # the last virtual stage (its loss)
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.dp_world_size > 1
        self.data_iterator = None
        if self.training_dataloader is not None and self._needs_data():
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        self._act_out = ActivationSender(grid.next_stage_rank)
        self._act_in = ActivationReceiver(grid.prev_stage_rank, self.device)
        self._grad_out = GradSender(grid.prev_stage_rank)
        self.agg_train_loss = None

    # -- DeepSpeed accessors ----------------------------------------------------------------------
    @property
    def micro_batches(self) -> int:
        """Micro-batches per ``train_batch``: the gradient accumulation steps, as they are now
        (``set_train_batch_size`` changes them)."""
        return self.gradient_accumulation_steps()

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _needs_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def set_dataiterator(self, iterator) -> None:
        self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        if self._needs_data():
            self.data_iterator = iter(loader)

    def reset_activation_shape(self) -> None:
        """Kept for DeepSpeed scripts: shapes are re-sent whenever they change."""

    # -- checkpoints ------------------------------------------------------------------------------
    def _weights_source(self):
        """Every stage's layers in one checkpoint, named by global layer index (loads at any number of
        stages, or into the same layers without a pipeline): the ordinary save (agreed errors, asynchronous
        when configured, ``zero_to_fp32.py``), with the module weights sent to rank 0 by every stage."""
        from shardwise.checkpoint import WeightsSource

        return WeightsSource.PIPELINE_STAGES

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """The ordinary load (names are layer-indexed, so any stage count works); ``load_module_strict``
        judges the layers this stage holds, as the checkpoint holds every stage's."""
        from shardwise.checkpoint.loading import check_stage_layers

        if load_module_strict:
            self.wait_for_checkpoint()  # a save in flight is committed first, so 'latest' names it
            check_stage_layers(self, load_dir, tag, stage_id=self.stage_id)
        return super().load_checkpoint(load_dir, tag=tag, load_module_strict=False,
                                       load_optimizer_states=load_optimizer_states,
                                       load_lr_scheduler_states=load_lr_scheduler_states,
                                       load_module_only=load_module_only)

    # -- the calls a pipeline does not take (DeepSpeed's PipelineEngine raises the same way) ---------
    def forward(self, *args, **kwargs):
        raise PipelineError(_ONLY_TRAIN_BATCH.format("forward"))

    def backward(self, *args, **kwargs):
        raise PipelineError(_ONLY_TRAIN_BATCH.format("backward"))

    def step(self, *args, **kwargs):
        raise PipelineError(_ONLY_TRAIN_BATCH.format("step"))

    # -- one batch --------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Train on the next ``gradient_accumulation_steps`` micro-batches; return the batch's mean loss
        (averaged over data-parallel replicas), the same tensor on every rank."""
        self._check_states_loaded("train_batch")
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled; use eval_batch() to evaluate")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        module, m = self.module, self.micro_batches  # (m: set_train_batch_size may change it between batches)
        module.train()
        batches = self._load_batches(m)
        schedule = sched.make_schedule(module.schedule, micro_batches=m, stages=self.num_stages,
                                       stage_id=self.stage_id, virtual_stages=module.virtual_stages)
        self._run(schedule, batches)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """Forward passes over the next micro-batches; the loss (mean over micro-batches and replicas with
        ``reduce_output='avg'``, the list of per-micro-batch losses with ``None``) on every rank, and with
        ``return_logits`` also the last stage's outputs (``None`` on other stages)."""
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self._check_states_loaded("eval_batch", forward=True)
        m = num_micro_batches or self.micro_batches
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.eval()
        batches = self._load_batches(m)
        schedule = sched.InferenceSchedule(m, self.num_stages, self.stage_id, self.module.virtual_stages)
        with torch.no_grad():
            state = self._run(schedule, batches, compute_loss=compute_loss, keep_logits=return_logits)
        if not compute_loss:
            out = state.logits if self.is_last_stage() else None
            return (out, out) if return_logits else out
        per_micro = self._replica_mean(state.losses, m)
        result = per_micro.sum() / m if reduce_output == "avg" else list(per_micro)
        self.module.train()
        if return_logits:
            return result, (state.logits if self.is_last_stage() else None)
        return result

    # -- data -------------------------------------------------------------------------------------
    def _load_batches(self, m: int) -> list:
        """The micro-batches of this batch (first and last stage); every rank learns if any ran out,
        so an exhausted iterator stops every stage with the same error instead of hanging them."""
        batches, problem = [], ""
        if self._needs_data():
            if self.data_iterator is None:
                problem = "no data: pass train_batch(data_iter=...) or initialize(training_data=...)"
            else:
                try:
                    for _ in range(m):
                        batches.append(next(self.data_iterator))
                except StopIteration:
                    problem = (f"the data iterator ran out after {len(batches)} of the {m} micro-batches of this "
                               "batch (gradient_accumulation_steps): wrap the loader in "
                               "shardwise.utils.RepeatingLoader or stop calling train_batch() earlier")
        failed = torch.tensor([1.0 if problem else 0.0])
        if comm.get_world_size() > 1:
            flags = torch.zeros(comm.get_world_size())
            flags[comm.get_rank()] = failed
            comm.all_reduce(flags)
        else:
            flags = failed
        bad = [int(r) for r in torch.nonzero(flags).flatten().tolist()]
        if bad:
            raise PipelineError(problem if problem else f"rank(s) {bad} (stage {self.stage_id} waits on them): "
                                "their data iterator ran out or is missing; no stage trained on this batch")
        return batches

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints activations with a function that may be reentrant, whose first
        checkpointed block is cut off from autograd unless the first stage's inputs require grad.
        shardwise's ``checkpointing.checkpoint`` is non-reentrant (DeepSpeed's default is reentrant), so only
        a function the user passed (``activation_checkpoint_func``) counts."""
        func = self.module.activation_checkpoint_func
        if func in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint):
            return False
        if self.module.activation_checkpoint_interval <= 0:
            return False
        return getattr(func, "keywords", {}).get("use_reentrant", True) is not False  # functools.partial(...)

    def _stage_inputs(self, batch):
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        tensors, single = as_tensors(inputs, "the data loader (first element of a batch)")
        needs_grad = torch.is_grad_enabled() and self._reentrant_activation_checkpointing()
        out = []
        for t in tensors:
            t = t.to(self.device)
            if t.is_floating_point() and self.precision.param_dtype != torch.float32:
                t = t.to(self.precision.param_dtype)
            out.append(t.detach().requires_grad_(needs_grad and t.is_floating_point()))
        return tuple(out), single

    def _labels(self, batch):
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
        if isinstance(labels, torch.Tensor):
            return labels.to(self.device)
        if isinstance(labels, (tuple, list)):
            return type(labels)(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in labels)
        return labels

    # -- running a schedule -----------------------------------------------------------------------
    def _run(self, schedule, batches, compute_loss: bool = True, keep_logits: bool = False) -> "_BatchState":
        st = _BatchState(schedule, batches)
        st.compute_loss = compute_loss
        st.keep_logits = keep_logits or not compute_loss
        handlers = {
            sched.LoadMicroBatch: self._exec_load,
            sched.RecvActivation: self._exec_recv_activation,
            sched.ForwardPass: self._exec_forward,
            sched.SendActivation: self._exec_send_activation,
            sched.RecvGrad: self._exec_recv_grad,
            sched.BackwardPass: self._exec_backward,
            sched.SendGrad: self._exec_send_grad,
            sched.ReduceTiedGrads: self._exec_reduce_tied,
            sched.ReduceGrads: self._exec_reduce_grads,
            sched.OptimizerStep: self._exec_optimizer_step,
        }
        with self.grid.active():  # layers called without a group use this engine's grid
            for ins in schedule.instructions():
                handlers[type(ins)](ins, st)
        self._act_out.wait()
        self._grad_out.wait()
        return st

    def _vs(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _is_last_vs(self, chunk: int) -> bool:
        return self._vs(chunk) == self._last_vs

    def _exec_load(self, ins, st) -> None:
        batch = st.batches[ins.micro_batch_id]
        if self._vs(ins.chunk) == 0:
            st.inputs[(ins.micro_batch_id, ins.chunk)] = self._stage_inputs(batch)
        if self._is_last_vs(ins.chunk):
            st.labels[ins.micro_batch_id] = self._labels(batch)

    def _exec_recv_activation(self, ins, st) -> None:
        tensors, single = self._act_in.recv()
        if torch.is_grad_enabled():
            for t in tensors:
                if t.is_floating_point():
                    t.requires_grad_()
        st.inputs[(ins.micro_batch_id, ins.chunk)] = (tensors, single)

    def _exec_forward(self, ins, st) -> None:
        key = (ins.micro_batch_id, ins.chunk)
        tensors, single = st.inputs[key]
        self.timers.start("forward")
        if self._autocast_dtype is None:
            out = self.module(tensors[0] if single else tensors, chunk=ins.chunk)
        else:  # the torch_autocast block
            with torch_autocast.autocast(self.device, self._autocast_dtype):
                out = self.module(tensors[0] if single else tensors, chunk=ins.chunk)
        self.timers.stop("forward")
        if self._is_last_vs(ins.chunk):
            if st.keep_logits:
                st.logits.append(out.detach() if isinstance(out, torch.Tensor) else out)
            if not st.compute_loss:
                return
            loss_fn = self.module.loss_fn
            loss = loss_fn(out, st.labels[ins.micro_batch_id]) if loss_fn is not None else out
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PipelineError(f"the loss of the last stage must be a scalar tensor, got "
                                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
                                    " (give PipelineModule a loss_fn, or make the last layer return the loss)")
            st.losses.append(loss.detach().float())
            st.outputs[key] = loss
            if not torch.is_grad_enabled():
                st.inputs.pop(key, None)
                st.outputs.pop(key, None)
            return
        out_tensors, out_single = as_tensors(out, lambda: f"pipeline stage {self.stage_id}'s "
                                             f"{self.module.stage_output_layer(ins.chunk)}")
        st.outputs[key] = (out_tensors, out_single)

    def _exec_send_activation(self, ins, st) -> None:
        key = (ins.micro_batch_id, ins.chunk)
        tensors, single = st.outputs[key]
        self._act_out.send(tensors, single)
        if not torch.is_grad_enabled():  # inference: nothing to keep for a backward
            st.outputs.pop(key)
            st.inputs.pop(key, None)

    def _exec_recv_grad(self, ins, st) -> None:
        key = (ins.micro_batch_id, ins.chunk)
        tensors, _ = st.outputs[key]
        st.grads[key] = recv_grads(self._act_out.peer, [tensors[i] for i in grad_slots(tensors)])

    def _exec_backward(self, ins, st) -> None:
        key = (ins.micro_batch_id, ins.chunk)
        st.backwards_done += 1
        boundary = st.backwards_done == st.total_backwards
        self.timers.start("backward")
        self.set_gradient_accumulation_boundary(boundary)  # the stage's last backward of the batch
        self._begin_backward()
        if self._is_last_vs(ins.chunk):
            self.train_step.scale(st.outputs.pop(key)).backward()
        else:
            tensors, _ = st.outputs.pop(key)
            grads = st.grads.pop(key)
            pairs = [(t, g) for t, g in zip([tensors[i] for i in grad_slots(tensors)], grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
        if boundary:  # the data-parallel reduction runs on while the input gradients go upstream (ReduceGrads)
            st.reduction_pending = True
        else:
            self._end_backward()
        self.set_gradient_accumulation_boundary(None)
        self.timers.stop("backward")
        inputs, _ = st.inputs.pop(key)
        if self._vs(ins.chunk) > 0:
            st.input_grads[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                   for t in (inputs[i] for i in grad_slots(inputs))]

    def _exec_send_grad(self, ins, st) -> None:
        self._grad_out.send(st.input_grads.pop((ins.micro_batch_id, ins.chunk)))

    def _exec_reduce_tied(self, ins, st) -> None:
        self._finish_reduction(st)  # tied gradients are summed over stages once reduced over replicas
        for key, c in self.module.tied_comms.items():  # (the module's groups; the sum is the engine's work)
            for p in self.module.tied_modules[key].parameters():
                if p.grad is not None:
                    comm.all_reduce(p.grad, group=c["group"])

    def _exec_reduce_grads(self, ins, st) -> None:
        self._finish_reduction(st)

    def _finish_reduction(self, st) -> None:
        """Wait for the gradient reduction the strategy launched during this stage's last backward."""
        if st.reduction_pending:
            st.reduction_pending = False
            self._end_backward()

    def _exec_optimizer_step(self, ins, st) -> None:
        self._check_can_step()
        m = st.micro_batches  # the batch's (as its schedule was made)
        self.agg_train_loss = self._replica_mean(st.losses, m).sum() / m
        self.timers.start("step")
        # the norm is taken over every stage (the grid's norm group), so all stages clip and skip together
        self._after_update(self.train_step.batch_step(m, batch_loss=self.agg_train_loss))

    def _replica_mean(self, losses, m: int) -> torch.Tensor:
        """Each micro-batch's loss averaged over the data-parallel replicas, the same on every rank (train
        and eval alike). Only the last stage holds losses, and each of its tensor ranks holds the same
        one: tensor rank 0 of the last stage contributes, once per replica. Under sequence parallelism the loss
        function returns the whole sequences' loss on every sequence rank (``gpt_loss`` does): sequence rank 0
        contributes."""
        vec = torch.zeros(m, dtype=torch.float32, device=self.device)
        sequence_rank = getattr(self.grid, "get_sequence_parallel_rank", lambda: 0)()
        if self.is_last_stage() and self.grid.get_tensor_model_parallel_rank() == 0 and sequence_rank == 0:
            vec += torch.stack([l.float().reshape(()) for l in losses]) / self.dp_world_size
        if comm.get_world_size() > 1:
            comm.all_reduce(vec)
        return vec


Engine.register(PipelineEngine)  # DeepSpeed's PipelineEngine is a DeepSpeedEngine to isinstance/issubclass


class _BatchState:
    """Buffers of one batch, keyed by (micro-batch, chunk)."""

    def __init__(self, schedule, batches) -> None:
        self.batches = batches
        self.micro_batches = schedule.micro_batches
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.labels: dict = {}
        self.grads: dict = {}
        self.input_grads: dict = {}
        self.losses: list = []
        self.logits: list = []
        self.compute_loss = True
        self.keep_logits = False
        self.backwards_done = 0
        self.reduction_pending = False
        self.total_backwards = sum(1 for k, _, _ in schedule.compute_order() if k == "B")
