"""Pipeline schedules as generators of small instructions, testable without processes.

A schedule is built for one stage (``stage_id`` of ``stages``) and ``micro_batches``; iterating
it yields the instructions that stage runs for one batch, in order. The engine executes them;
tests check properties of them (every forward before its backward, every send matched by a
receive, how many activations are kept) by simulating all stages at once.

Each schedule first decides the order of the stage's computations (``compute_order``: forward
and backward passes of (micro-batch, chunk)); communication is then placed around them: a
receive right before the pass that needs it, a send right after the pass that produced it.
Sends are asynchronous and receives block, so an order that some global execution can follow
never deadlocks. Instruction names follow DeepSpeed's ``deepspeed.runtime.pipe.schedule``.

Iterating a schedule yields one *step* at a time, a list of instructions, as DeepSpeed's schedules do:
a step holds at most one computation, preceded by the sends of the previous step's result and the
receives it needs (a step may be empty: the stage waits). ``TrainSchedule`` (1F1B) and
``InferenceSchedule`` follow DeepSpeed's clock: 2 * (micro_batches + stages - 1) and
micro_batches + stages - 1 steps, the same on every stage; the other schedules use one step per
computation. ``instructions()`` is the same program as one flat sequence (what the engine runs).

Virtual stages: with ``virtual_stages = v`` each rank holds ``v`` chunks of the model; chunk
``c`` of rank ``s`` is virtual stage ``c * stages + s``, so activations travel
0 -> 1 -> ... -> stages-1 -> 0 (next chunk) -> ... and gradients the other way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class PipeInstruction:
    """One step of a schedule. ``micro_batch_id`` and ``chunk`` say which buffer it works on."""

    micro_batch_id: int = -1
    chunk: int = 0
    # the slot among num_pipe_buffers() that a micro-batch's activations take, reused cyclically
    # (DeepSpeed's name; shardwise's engine keys its buffers by (micro_batch_id, chunk))
    buffer_id: int = field(default=-1, compare=False)

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        if self.micro_batch_id < 0:
            return f"{self.name}()"
        return f"{self.name}(mb={self.micro_batch_id}" + (f", chunk={self.chunk})" if self.chunk else ")")


class BufferOpInstruction(PipeInstruction):
    """An instruction working on one micro-batch's buffers."""


class LoadMicroBatch(BufferOpInstruction):
    """First stage: take the inputs of the micro-batch; last stage: its labels."""


class ForwardPass(BufferOpInstruction):
    pass


class BackwardPass(BufferOpInstruction):
    pass


class SendActivation(BufferOpInstruction):
    pass


class RecvActivation(BufferOpInstruction):
    pass


class SendGrad(BufferOpInstruction):
    pass


class RecvGrad(BufferOpInstruction):
    pass


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied layers over the stages holding them."""


class ReduceGrads(PipeInstruction):
    """Finish the data-parallel gradient reduction (ZeRO strategy)."""


class OptimizerStep(PipeInstruction):
    pass


class PipeSchedule:
    """Base class: subclasses define ``compute_order``; ``steps()`` adds loads, sends and receives."""

    train = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id {stage_id} outside 0..{stages - 1}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.virtual_stages = virtual_stages

    # -- what subclasses define -----------------------------------------------------------------
    def compute_order(self) -> list[tuple[str, int, int]]:
        """``("F" | "B", micro_batch_id, chunk)`` in the order this stage runs them."""
        raise NotImplementedError

    # -- derived ----------------------------------------------------------------------------------
    @property
    def num_virtual(self) -> int:
        return self.stages * self.virtual_stages

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.stages + self.stage_id

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def clock(self, order: list[tuple[str, int, int]]) -> tuple[list[int], int]:
        """The step of each computation of ``order`` and the number of steps: one step each here;
        schedules with a common clock over all stages override it."""
        sends_last = bool(order) and self._sends(*order[-1])
        return list(range(len(order))), len(order) + sends_last

    def _sends(self, kind: str, mb: int, chunk: int) -> bool:
        """Whether this computation's result goes to another stage."""
        vs = self.virtual_stage(chunk)
        return vs < self.num_virtual - 1 if kind == "F" else vs > 0

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One list of instructions per step: the sends of the previous step's result, the receives and
        load this step's computation needs, the computation; the last step ends with the reductions and
        the optimizer step (training). Sends are asynchronous and receives block, so the program is the
        order of computations with each receive right before the pass that needs it and each send right
        after the pass that produced it: an order some global execution can follow never deadlocks."""
        order = self.compute_order()
        when, total = self.clock(order)
        last = self.num_virtual - 1
        buffers = max(1, self.num_pipe_buffers())
        program: list[list[PipeInstruction]] = [[] for _ in range(total)]
        for (kind, mb, chunk), t in zip(order, when):
            vs = self.virtual_stage(chunk)
            here, after = program[t], program[t + 1] if t + 1 < total else []
            b = mb % buffers
            if kind == "F":
                if vs > 0:
                    here.append(RecvActivation(mb, chunk, b))
                if vs == 0 or vs == last:
                    here.append(LoadMicroBatch(mb, chunk, b))
                here.append(ForwardPass(mb, chunk, b))
                if vs < last:
                    after.insert(0, SendActivation(mb, chunk, b))
            else:
                if vs < last:
                    here.append(RecvGrad(mb, chunk, b))
                here.append(BackwardPass(mb, chunk, b))
                if vs > 0:
                    after.insert(0, SendGrad(mb, chunk, b))
        if self.train:
            program[-1] += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield from program

    def instructions(self) -> Iterator[PipeInstruction]:
        """The steps' instructions as one sequence."""
        for step in self.steps():
            yield from step

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def num_pipe_buffers(self) -> int:
        """Most forward passes whose activations are held at once (awaiting their backward)."""
        live = peak = 0
        for kind, _, _ in self.compute_order():
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        return peak

    def __repr__(self) -> str:
        v = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}, " \
               f"stage_id={self.stage_id}{v})"


class TrainSchedule(PipeSchedule):
    """1F1B (PipeDream-flush, DeepSpeed's default): ``stages - stage_id - 1`` warm-up forwards,
    then one forward and one backward alternately, then the remaining backwards. A stage holds at
    most ``stages - stage_id`` micro-batches' activations."""

    def compute_order(self):
        m = self.micro_batches
        warmup = min(self.stages - self.stage_id - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        return order

    def clock(self, order):
        """DeepSpeed's clock: the forward of micro-batch i at step 2i + stage_id, its backward at
        2i + 2 * stages - stage_id - 1, of 2 * (micro_batches + stages - 1) steps (the same order as
        compute_order; idle steps are empty)."""
        p, s = self.stages, self.stage_id
        when = [2 * mb + (s if k == "F" else 2 * p - s - 1) for k, mb, _ in order]
        if any(a >= b for a, b in zip(when, when[1:])):  # not 1F1B's order (a subclass reordered it)
            return super().clock(order)
        return when, 2 * (self.micro_batches + p - 1)


class GPipeSchedule(PipeSchedule):
    """All forwards, then all backwards (in reverse): every micro-batch's activations are held."""

    def compute_order(self):
        m = self.micro_batches
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))]


class InterleavedSchedule(PipeSchedule):
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): each rank runs ``virtual_stages`` chunks,
    forwards going through chunk 0 of every micro-batch group before chunk 1, which shrinks the
    bubble by ``virtual_stages``. Needs ``micro_batches`` to be a multiple of ``stages``."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 2) -> None:
        super().__init__(micro_batches, stages, stage_id, virtual_stages)
        if virtual_stages < 2:
            raise ValueError("the interleaved schedule needs virtual_stages >= 2")
        if micro_batches % stages:
            raise ValueError(f"the interleaved schedule needs the number of micro-batches "
                             f"(gradient_accumulation_steps={micro_batches}) to be a multiple of the number of "
                             f"stages ({stages})")

    def _unit(self, k: int, forward: bool) -> tuple[int, int]:
        p, v = self.stages, self.virtual_stages
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return mb, chunk

    def compute_order(self):
        p, v = self.stages, self.virtual_stages
        total = self.micro_batches * v
        warmup = min(total, (p - self.stage_id - 1) * 2 + (v - 1) * p)
        order = [("F", *self._unit(k, True)) for k in range(warmup)]
        for i in range(total - warmup):
            order += [("F", *self._unit(warmup + i, True)), ("B", *self._unit(i, False))]
        order += [("B", *self._unit(k, False)) for k in range(total - warmup, total)]
        return order


class InferenceSchedule(PipeSchedule):
    """Forward passes only (``eval_batch``)."""

    train = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id, virtual_stages)
        if virtual_stages > 1 and micro_batches % stages:
            raise ValueError(f"with virtual stages the number of micro-batches ({micro_batches}) must be a "
                             f"multiple of the number of stages ({stages})")

    def compute_order(self):
        return [("F", i, c) for i in range(self.micro_batches) for c in range(self.virtual_stages)] \
            if self.virtual_stages == 1 else [("F", *InterleavedSchedule._unit(self, k, True))
                                              for k in range(self.micro_batches * self.virtual_stages)]

    def clock(self, order):
        """DeepSpeed's clock without virtual stages: the forward of micro-batch i at step i + stage_id,
        of micro_batches + stages - 1 steps."""
        if self.virtual_stages > 1:
            return super().clock(order)
        return [mb + self.stage_id for _, mb, _ in order], self.micro_batches + self.stages - 1


SCHEDULES = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule, "interleaved": InterleavedSchedule}


def make_schedule(name: str, *, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1):
    cls = SCHEDULES[name]
    if cls is InterleavedSchedule:
        return cls(micro_batches, stages, stage_id, virtual_stages)
    return cls(micro_batches, stages, stage_id)


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a step predicted for ``micro_batches`` on ``stages``: (p-1)/(v*m + p-1)."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)
