"""Pipeline schedules, simulated for all stages at once (no processes).

The simulator runs every stage's instruction list: a send appends to the channel of its
(sender, receiver, kind); a receive blocks until its channel has a message, and that message
must be the one it expects. Sends never block (the engine sends asynchronously). No stage able
to move while some have work left is a deadlock.
"""
from __future__ import annotations

import pytest

from shardwise.pipe import schedule as S


def simulate(schedules):
    """Run all stages' instructions; return per-stage executed lists and the peak of held activations."""
    p = schedules[0].stages
    v = schedules[0].virtual_stages
    last = p * v - 1
    progs = [list(s.instructions()) for s in schedules]
    pos = [0] * p
    channels: dict[tuple, list] = {}
    done_f, done_b = set(), set()  # (virtual stage, mb)
    held = [0] * p
    peak = [0] * p
    sent = received = 0
    while any(pos[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(progs[s]):
                ins = progs[s][pos[s]]
                vs = ins.chunk * p + s
                mb = ins.micro_batch_id
                if isinstance(ins, S.SendActivation):
                    assert (vs, mb) in done_f, f"stage {s} sends activation {ins} before its forward"
                    channels.setdefault(((vs + 1) % p, "act"), []).append((vs + 1, mb))
                    sent += 1
                elif isinstance(ins, S.SendGrad):
                    assert (vs, mb) in done_b, f"stage {s} sends grad {ins} before its backward"
                    channels.setdefault(((vs - 1) % p, "grad"), []).append((vs - 1, mb))
                    sent += 1
                elif isinstance(ins, (S.RecvActivation, S.RecvGrad)):
                    kind = "act" if isinstance(ins, S.RecvActivation) else "grad"
                    q = channels.get((s, kind), [])
                    if not q:
                        break  # blocked
                    got = q.pop(0)
                    assert got == (vs, mb), f"stage {s} {ins} received the message for {got} instead"
                    received += 1
                elif isinstance(ins, S.ForwardPass):
                    if vs > 0:
                        assert (vs - 1, mb) in done_f
                    done_f.add((vs, mb))
                    held[s] += 1
                    peak[s] = max(peak[s], held[s])
                elif isinstance(ins, S.BackwardPass):
                    assert (vs, mb) in done_f, f"stage {s}: {ins} before its forward"
                    if vs < last:
                        assert (vs + 1, mb) in done_b, f"stage {s}: {ins} before the next stage's backward"
                    done_b.add((vs, mb))
                    held[s] -= 1
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: progs[s][pos[s]] for s in range(p) if pos[s] < len(progs[s])}
            raise AssertionError(f"deadlock: stages blocked at {stuck}")
    assert all(not q for q in channels.values()), f"messages never received: {channels}"
    assert sent == received
    return progs, peak, done_f, done_b


CASES = [(2, 4), (4, 8), (4, 3)]


@pytest.mark.parametrize("stages,micro", CASES)
@pytest.mark.parametrize("cls", [S.TrainSchedule, S.GPipeSchedule])
def test_schedule_is_complete_and_deadlock_free(cls, stages, micro):
    scheds = [cls(micro, stages, s) for s in range(stages)]
    progs, peak, done_f, done_b = simulate(scheds)
    expected = {(vs, mb) for vs in range(stages) for mb in range(micro)}
    assert done_f == expected and done_b == expected
    for s, prog in enumerate(progs):
        names = [i.name for i in prog]
        assert names[-3:] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        assert names.count("ForwardPass") == names.count("BackwardPass") == micro
        loads = [i.micro_batch_id for i in prog if isinstance(i, S.LoadMicroBatch)]
        assert loads == (list(range(micro)) if s in (0, stages - 1) else [])
        assert peak[s] == scheds[s].num_pipe_buffers()
        if cls is S.TrainSchedule:
            assert peak[s] <= stages  # 1F1B: at most `stages` activations in flight
            assert peak[s] == min(stages - s, micro)
        else:
            assert peak[s] == micro  # GPipe keeps every micro-batch's activations


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (2, 2), (4, 4)])
def test_interleaved_two_chunks(stages, micro):
    scheds = [S.InterleavedSchedule(micro, stages, s, virtual_stages=2) for s in range(stages)]
    progs, peak, done_f, done_b = simulate(scheds)
    expected = {(vs, mb) for vs in range(2 * stages) for mb in range(micro)}
    assert done_f == expected and done_b == expected
    for prog in progs:
        assert [i.name for i in prog].count("ForwardPass") == 2 * micro


def test_interleaved_needs_multiple_of_stages():
    with pytest.raises(ValueError, match="multiple of the number of stages"):
        S.InterleavedSchedule(3, 2, 0, virtual_stages=2)


def test_one_f_one_b_order_and_inference():
    order = S.TrainSchedule(4, 2, 0).compute_order()
    assert order == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("F", 3, 0),
                     ("B", 2, 0), ("B", 3, 0)]
    progs, _, done_f, done_b = simulate([S.InferenceSchedule(3, 2, s) for s in range(2)])
    assert len(done_f) == 6 and not done_b
    assert not any(isinstance(i, S.OptimizerStep) for p in progs for i in p)


def test_simulator_catches_a_bad_schedule():
    class Broken(S.TrainSchedule):  # stage 0 runs its backwards in the wrong order
        def compute_order(self):
            order = super().compute_order()
            if self.stage_id == 0:
                bs = [o for o in order if o[0] == "B"]
                fs = [o for o in order if o[0] == "F"]
                return fs + list(reversed(bs))
            return order
    with pytest.raises(AssertionError, match="received the message"):
        simulate([Broken(4, 2, s) for s in range(2)])


def test_steps_are_lists_on_deepspeeds_clock():
    """Iterating a schedule gives one list per step (DeepSpeed's layout): 1F1B and inference on a clock
    common to all stages, idle steps empty, at most one computation a step, each result sent at the
    start of the next step; the flat program is the steps' instructions in order."""
    micro, stages = 4, 3
    for s in range(stages):
        sched = S.TrainSchedule(micro, stages, s)
        steps = list(sched)
        assert len(steps) == 2 * (micro + stages - 1) and all(isinstance(st, list) for st in steps)
        assert [i for st in steps for i in st] == list(sched.instructions())
        for t, st in enumerate(steps):
            passes = [i for i in st if isinstance(i, (S.ForwardPass, S.BackwardPass))]
            assert len(passes) <= 1
            for i in passes:  # DeepSpeed's clock: forwards on steps of the stage's parity, backwards on the other
                mb = i.micro_batch_id
                assert t == (2 * mb + s if isinstance(i, S.ForwardPass) else 2 * mb + 2 * stages - s - 1)
                assert all(0 <= j.buffer_id < sched.num_pipe_buffers() for j in st if isinstance(j, S.BufferOpInstruction))
            sends = [k for k, i in enumerate(st) if isinstance(i, (S.SendActivation, S.SendGrad))]
            assert sends in ([], [0])
            if sends:
                prev = [i for i in steps[t - 1] if isinstance(i, (S.ForwardPass, S.BackwardPass))]
                assert prev and prev[0].micro_batch_id == st[0].micro_batch_id
        assert sched.is_first_stage == (s == 0) and sched.is_last_stage == (s == stages - 1)
    assert [[i.name for i in st] for st in S.TrainSchedule(2, 1, 0)] == [
        ["LoadMicroBatch", "ForwardPass"], ["BackwardPass"], ["LoadMicroBatch", "ForwardPass"],
        ["BackwardPass", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]]
    assert [[i.name for i in st] for st in S.InferenceSchedule(2, 3, 1)] == [
        [], ["RecvActivation", "ForwardPass"], ["SendActivation", "RecvActivation", "ForwardPass"], ["SendActivation"]]
    # the other schedules: one step per computation, plus one for a last send
    assert len(list(S.GPipeSchedule(3, 2, 0))) == 2 * 3 and len(list(S.GPipeSchedule(3, 2, 1))) == 2 * 3 + 1


def test_bubble_fraction():
    assert S.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert S.bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)
