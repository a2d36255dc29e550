"""Fault-tolerance test script (tests/test_fault_tolerance.py): a tiny regression on replica groups.

Arguments: OUT_DIR STEPS [--stage S] [--kill_at K] [--late S] [--save DIR] [--load DIR] [--no_ft]

* ``--kill_at K``: replica group 1, rank 0, on its first attempt, kill -9 itself during step K (after
  backward, before the update: the step in flight);
* ``--late S``: replica group 1 sleeps S seconds before it starts (a late joiner; give the others a
  ``--quorum_timeout`` shorter than S, so that they start without it);
* with ``--kill_at`` or ``--late``: train STEPS steps, and on until the replica groups have trained 3
  steps together again (the survivor goes on alone while the other restarts);
* ``--save DIR`` / ``--load DIR``: a checkpoint at the end / loaded at the start (when not recovered);
* ``--no_ft``: the same training without the fault_tolerance block (one replica group's data share).
* ``--algorithm A --sync_every N``: fault_tolerance.algorithm (diloco: the paper's outer optimizer,
  SGD lr 0.7, Nesterov momentum 0.9); ``--sgd LR``: plain SGD at LR, no scheduler, no clipping;
  ``--trace``: record each step's weights before and after the update and the gradients it stepped.

Writes OUT_DIR/r{replica}_{rank}_a{attempt}.json: the step counter at every step, the losses by step,
whether and at which step the group took a peer's state, and the final weights.
"""
import argparse
import json
import os
import signal
import time

import torch

import shardwise
from shardwise.utils import RepeatingLoader, safe_get_full_fp32_param
from shardwise import comm

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("steps", type=int)
p.add_argument("--stage", type=int, default=0)
p.add_argument("--kill_at", type=int, default=None)
p.add_argument("--late", type=float, default=0.0)
p.add_argument("--save", default=None)
p.add_argument("--load", default=None)
p.add_argument("--no_ft", action="store_true")
p.add_argument("--quorum_timeout", type=float, default=60.0)
p.add_argument("--step_sleep", type=float, default=0.0)
p.add_argument("--algorithm", default="ddp")
p.add_argument("--sync_every", type=int, default=None)
p.add_argument("--sgd", type=float, default=None)
p.add_argument("--trace", action="store_true")
p.add_argument("--local_rank", type=int, default=0)
args = p.parse_args()

replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if replica == 1 and args.late and attempt == 0:
    time.sleep(args.late)

torch.manual_seed(0)
w_true = torch.randn(8, 1)
x = torch.randn(256, 8)
data = torch.utils.data.TensorDataset(x, x @ w_true + 0.01 * torch.randn(256, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.02}},
    "zero_optimization": {"stage": args.stage},
    "gradient_clipping": 1.0,
}
if args.sgd is not None:
    config["optimizer"] = {"type": "SGD", "params": {"lr": args.sgd}}
    del config["scheduler"]
    config["gradient_clipping"] = 0.0
if not args.no_ft:
    config["fault_tolerance"] = {"enabled": True, "min_replicas": 1, "quorum_timeout": args.quorum_timeout,
                                 "timeout": 60, "connect_timeout": 30, "algorithm": args.algorithm}
    if args.sync_every is not None:
        config["fault_tolerance"]["sync_every"] = args.sync_every
engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=data)
ft = engine.fault_tolerance
rank = comm.get_rank()
start_step = engine.global_steps
if args.load and not (ft is not None and ft.recovered):
    engine.load_checkpoint(args.load)
record = {"replica": replica, "rank": rank, "attempt": attempt, "start_step": start_step, "trace": [],
          "recovered": bool(ft and ft.recovered), "recovered_at_step": ft.recovered_at_step if ft else None,
          "loaded_step": engine.global_steps, "steps": [], "losses": {}}
path = os.path.join(args.out, f"r{replica}_{rank}_a{attempt}.json")


def dump():
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


it = iter(RepeatingLoader(loader))
marker = os.path.join(args.out, "rejoined_at")
if ft is not None and ft.recovered:  # tell the survivors from which step the groups train together again
    with open(marker + f".{rank}", "w") as f:
        f.write(str(ft.recovered_at_step))
    os.replace(marker + f".{rank}", marker)


def done():
    """STEPS steps; after a fault or a late start, on until 3 steps after the other group took this one's
    state (the survivor goes on alone while the other group restarts; both stop at the same step)."""
    if ft is None or not (args.kill_at is not None or args.late):
        return engine.global_steps >= args.steps
    if not os.path.exists(marker) or ft.participants != int(os.environ["NUM_REPLICA_GROUPS"]):
        return False
    with open(marker) as f:
        rejoined = int(f.read())
    return engine.global_steps >= max(args.steps, rejoined + 3)


while not done():
    xb, yb = next(it)
    step = engine.global_steps
    record["steps"].append(step)
    loss = torch.nn.functional.mse_loss(engine(xb), yb)
    engine.backward(loss)
    if args.trace:
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts]).tolist()  # noqa: E731
        params = list(engine.module.parameters())
        record["trace"].append({"step": step, "before": flat(params), "grad": flat([p.grad for p in params])})
    if args.kill_at is not None and replica == 1 and attempt == 0 and step == args.kill_at and rank == 0:
        dump()
        os.kill(os.getpid(), signal.SIGKILL)
    engine.step()
    if args.trace:
        record["trace"][-1]["after"] = flat(engine.module.parameters())
    if engine.global_steps > step:
        record["losses"][str(step)] = engine.get_loss()
    if ft is not None and args.kill_at is not None and ft.participants < int(os.environ["NUM_REPLICA_GROUPS"]):
        time.sleep(0.1)  # alone: leave the restarting group's start-up some of the CPU
    time.sleep(args.step_sleep)
    dump()

if args.save and replica == 0:  # one replica group saves (every group holds the same state)
    engine.save_checkpoint(args.save, tag="end")
params = {}
for name, t in engine.module.named_parameters():
    full = safe_get_full_fp32_param(t)
    params[name] = full.reshape(-1).tolist()
record["params"] = params
record["final_step"] = engine.global_steps
record["discarded"] = ft.discarded_steps if ft else 0
record["recovered"] = bool(ft and ft.recovered)
record["recovered_at_step"] = ft.recovered_at_step if ft else None
dump()
