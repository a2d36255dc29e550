"""The fine-tuning matrix: the set-ups people run (a Hugging Face causal LM, full fine-tuning or LoRA through
peft, gradient checkpointing, ZeRO 0-3, CPU offload, gradient accumulation), each trained on 2 ranks and
compared with one process training the same model on the whole batch (fp32: losses to rtol 1e-6, the
trained parameters to 1e-4 absolute after 2 AdamW steps of lr 1e-2).

    python tests/finetune_matrix.py --list [FILTER ...]     # the cells (all, or those whose name has every FILTER)
    python tests/finetune_matrix.py [--suite] [FILTER ...]  # run them (plain-loop cells in one 2-rank group,
                                                            # Trainer cells in one 2-process launch)

A cell's name lists its axes: ``loop-lora-reentrant-z3-offload-gas2-gqa-auto``:
* ``loop`` (a plain loop over ``shardwise.initialize``) or ``trainer`` (Hugging Face ``Trainer`` with
  ``TrainingArguments(deepspeed=...)`` through the compatibility package);
* ``full`` fine-tuning, ``lora`` (peft, frozen base, on the attention and MLP projections) or ``mts`` (LoRA
  with ``modules_to_save=["lm_head"]``);
* checkpointing: ``none``, ``reentrant`` / ``nonreentrant`` (transformers' ``activation_checkpointing_enable``
  with torch's checkpoint) or ``swckpt`` (``shardwise.checkpointing.checkpoint``, DeepSpeed's API, configured
  with ``cpu_checkpointing``);
* ``z0``-``z3``; ``offload`` (optimizer on the CPU, and parameters at stage 3) or ``gpu`` (none);
* ``gas1`` / ``gas2`` (gradient accumulation);
* the model: ``mha`` (as many key/value heads as query heads), ``gqa`` (2 key/value heads for 4 query
  heads) or ``tied`` (tied input and output embeddings);
* at stage 3 the unit size (``stage3_prefetch_bucket_size``): ``auto`` (as transformers fills it:
  0.9 x hidden², persistence threshold 10 x hidden), ``tiny`` (every module its own unit) or ``big``
  (5e7: the whole model one unit).
Trainer cells may instead name a config shipped by a fine-tuning framework (``tests/fixtures/finetune_configs``,
"auto" values filled by transformers), e.g. ``trainer-lora-nonreentrant-ds_z3_offload-gas2-gqa``.

tests/test_finetune_matrix.py runs a covering subset (``suite_cells()``: every value of every axis, and
every pair of the axes that interact with ZeRO-3's gathering, at least once).
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = HERE / "fixtures" / "finetune_configs"
TRAINER_SCRIPT = HERE / "scripts" / "finetune_matrix_trainer.py"

HIDDEN, VOCAB, SEQ, MICRO, STEPS, LR = 32, 96, 8, 2, 2, 1e-2
RTOL = 1e-6  # losses, relative
PARAM_TOL = 1e-4  # trained parameters, absolute (lr 1e-2; Adam divides by the root of tiny second moments)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

APIS = ("loop", "trainer")
TUNINGS = ("full", "lora", "mts")
CKPTS = ("none", "reentrant", "nonreentrant", "swckpt")
STAGES = (0, 1, 2, 3)
OFFLOADS = (False, True)
GAS = (1, 2)
SHAPES = ("mha", "gqa", "tied")
UNITS = ("auto", "tiny", "big")
FRAMEWORK_CONFIGS = ("ds_z0", "ds_z2", "ds_z2_offload", "ds_z3", "ds_z3_offload", "zero3_bf16_auto")


@dataclass(frozen=True)
class Cell:
    api: str = "loop"
    tuning: str = "lora"
    ckpt: str = "none"
    stage: int = 3
    offload: bool = False
    gas: int = 1
    shape: str = "gqa"
    unit: str = "auto"  # stage 3 only ("-" otherwise)
    config: str | None = None  # a framework's shipped config (Trainer cells): replaces stage/offload/unit

    @property
    def name(self) -> str:
        if self.config is not None:
            return f"{self.api}-{self.tuning}-{self.ckpt}-{self.config}-gas{self.gas}-{self.shape}"
        unit = f"-{self.unit}" if self.stage == 3 else ""
        return (f"{self.api}-{self.tuning}-{self.ckpt}-z{self.stage}-{'offload' if self.offload else 'gpu'}"
                f"-gas{self.gas}-{self.shape}{unit}")

    def __repr__(self) -> str:
        return self.name


def all_cells() -> list[Cell]:
    """The whole cartesian matrix (invalid combinations left out: no offload at stage 0, unit sizes only at
    stage 3), plus the framework configs under the Trainer."""
    cells = []
    for api, tuning, ckpt, stage, offload, gas, shape in itertools.product(APIS, TUNINGS, CKPTS, STAGES, OFFLOADS,
                                                                          GAS, SHAPES):
        if stage == 0 and offload:
            continue
        for unit in UNITS if stage == 3 else ("-",):
            cells.append(Cell(api, tuning, ckpt, stage, offload, gas, shape, unit))
    for config, tuning, ckpt, gas, shape in itertools.product(FRAMEWORK_CONFIGS, TUNINGS, CKPTS, GAS, SHAPES):
        cells.append(Cell("trainer", tuning, ckpt, -1, False, gas, shape, "-", config))
    return cells


def suite_cells() -> list[Cell]:
    """The subset the test suite runs. Stage 3: one cell per (checkpointing, unit size) pair, the tuning
    rotated so that every (tuning, checkpointing) and (tuning, unit size) pair appears too, the model shape
    so that every (shape, unit size) pair does (LoRA with grouped key/value heads at the "auto" unit size is
    among them: a peft ``lora.Linear`` around ``v_proj`` fills one unit). Stages 0-2: every tuning once each,
    the checkpointing modes rotated. Offload and gradient accumulation alternate. Then the Trainer on the
    framework configs."""
    cells = []
    flip = [(False, 1), (True, 2), (True, 1), (False, 2)]
    for i, ckpt in enumerate(CKPTS):
        for j, unit in enumerate(UNITS):
            tuning = TUNINGS[(i + j) % 3]
            shape = SHAPES[(i + 2 * j) % 3]
            offload, gas = flip[(i + j) % 4]
            cells.append(Cell("loop", tuning, ckpt, 3, offload, gas, shape, unit))
    for stage in (0, 1, 2):
        for k, tuning in enumerate(TUNINGS):
            ckpt = CKPTS[(stage + k) % 4]
            offload = stage > 0 and (stage + k) % 2 == 1
            gas, shape = 1 + (stage + k) % 2, SHAPES[(stage + 2 * k) % 3]
            cells.append(Cell("loop", tuning, ckpt, stage, offload, gas, shape, "-"))
    cells += trainer_suite_cells()
    return cells


def trainer_suite_cells() -> list[Cell]:
    return [
        Cell("trainer", "lora", "reentrant", config="ds_z3", gas=2, shape="gqa"),  # (crash a, the framework's way)
        Cell("trainer", "full", "nonreentrant", config="ds_z3_offload", gas=1, shape="tied"),
        Cell("trainer", "mts", "none", config="ds_z2", gas=2, shape="mha"),
        Cell("trainer", "lora", "nonreentrant", stage=3, unit="big", gas=1, shape="gqa"),  # (crash b: loss *= world)
    ]


# ------------------------------------------------------------------------------------------- the model

def build_model(cell: Cell):
    """The tiny Llama of the cell's shape, checkpointing and tuning (same weights on every call)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2 if cell.shape == "gqa" else 4,
                         max_position_embeddings=32, tie_word_embeddings=cell.shape == "tied", use_cache=False)
    model = LlamaForCausalLM(config)
    if cell.ckpt in ("reentrant", "nonreentrant"):
        reentrant = cell.ckpt == "reentrant"
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    elif cell.ckpt == "swckpt":
        from shardwise import checkpointing

        model.activation_checkpointing_enable()  # (then the checkpoint function is DeepSpeed's API's)
        model._set_gradient_checkpointing(True, checkpointing.checkpoint)
    if cell.tuning != "full":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                          modules_to_save=["lm_head"] if cell.tuning == "mts" else None)
        model = get_peft_model(model, lora)
    return model


def data(cell: Cell, world: int) -> torch.Tensor:
    """[steps, gas, world * micro, seq] token ids."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, VOCAB, (STEPS, cell.gas, world * MICRO, SEQ), generator=g)


def stage3_sizes(unit: str) -> dict:
    if unit == "auto":  # what transformers writes for "auto" (integrations/deepspeed.py)
        return {"stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                "stage3_param_persistence_threshold": 10 * HIDDEN, "reduce_bucket_size": HIDDEN * HIDDEN}
    if unit == "tiny":
        return {"stage3_prefetch_bucket_size": 16, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}
    return {"stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 0}  # (big)


def ds_config(cell: Cell) -> dict:
    zero = {"stage": cell.stage}
    if cell.stage == 3:
        zero.update(stage3_sizes(cell.unit))
    if cell.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if cell.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": cell.gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}
    if cell.ckpt == "swckpt":
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    return cfg


# ------------------------------------------------------------------------------------------- reference

_REFERENCES: dict = {}


def reference(cell: Cell, world: int):
    """One process, plain PyTorch, the whole global batch of each step: (losses, trained trainable params)."""
    key = (cell.tuning, cell.shape, cell.gas, world)
    if key not in _REFERENCES:
        model = build_model(replace(cell, ckpt="none"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
        losses = []
        for step in data(cell, world):
            ids = step.reshape(-1, SEQ)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
        _REFERENCES[key] = (losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    return _REFERENCES[key]


# ------------------------------------------------------------------------------------------- a plain loop

def run_loop_cell(cell: Cell, rank: int, world: int) -> dict:
    """Train the cell on this rank (inside a process group) and check it against one process; returns what
    was measured."""
    import torch.distributed as dist

    import shardwise
    from shardwise import checkpointing

    model = build_model(cell)
    engine, *_ = shardwise.initialize(model=model, config=ds_config(cell))
    late = []  # at ZeRO-3: units gathered when backward reaches the embeddings' output (its very end)
    if cell.stage == 3 and cell.unit != "big":
        def record(grad):
            late.extend(u.names[0] for u in engine.strategy.units if u.gathered and not u.persistent
                        and not any("embed_tokens" in n or "layers.0." in n for n in u.names))

        def hook(module, args, output):
            if output.requires_grad:
                output.register_hook(record)

        model.get_input_embeddings().register_forward_hook(hook)
    try:
        losses = []
        for step in data(cell, world):
            total = torch.zeros(())
            for micro in step:
                ids = micro[rank * MICRO : (rank + 1) * MICRO]
                loss = engine(input_ids=ids, labels=ids).loss
                loss *= world  # (in place on the engine's output, as the Trainer does)
                engine.backward(loss / world)
                engine.step()
                total += loss.detach() / world
            dist.all_reduce(total)
            losses.append(total.item() / (world * cell.gas))
        out = {"losses": losses, "params": _trained(engine), "memory": _partitioned_state(engine)}
        out["memory"]["late"] = late
    finally:
        checkpointing.reset()
    ref_losses, ref_params = reference(cell, world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert set(out["params"]) == set(ref_params), sorted(set(out["params"]) ^ set(ref_params))
    for n, v in ref_params.items():
        torch.testing.assert_close(out["params"][n], v, rtol=0, atol=PARAM_TOL, msg=lambda m: f"{n}: {m}")
    assert max((v - build_reference_init(cell)[n]).abs().max().item() for n, v in out["params"].items()) > 1e-4
    if cell.stage == 3:
        # Released during backward once used (frozen ones and recomputed ones too), the last layer's first:
        # only the first layer and the embeddings may still be gathered when backward reaches them.
        assert late == [], late
        assert out["memory"]["gathered"] == [], out["memory"]  # back to the partitioned state after the step
        assert out["memory"]["full_data"] == [], out["memory"]
    return {"losses": losses, "memory": out["memory"]}


_INITS: dict = {}


def build_reference_init(cell: Cell) -> dict:
    key = (cell.tuning, cell.shape)
    if key not in _INITS:
        _INITS[key] = {n: p.detach().clone() for n, p in build_model(replace(cell, ckpt="none")).named_parameters()
                       if p.requires_grad}
    return _INITS[key]


def _trained(engine) -> dict:
    from shardwise.zero import GatheredParameters

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def _partitioned_state(engine) -> dict:
    """At stage 3: units still gathered (not persistent) and parameters whose ``.data`` is not empty."""
    strategy = engine.strategy
    units = getattr(strategy, "units", [])
    gathered = [u.names[0] for u in units if u.gathered and not u.persistent]
    full = [n for u in units if not u.persistent for n, p in zip(u.names, u.params) if p.data.numel()]
    return {"gathered": gathered, "full_data": full, "live_params": strategy.memory_parts().get("live_params", 0)}


def loop_body(rank: int, world: int, cells: list[Cell]) -> list:
    sys.path.insert(0, str(HERE))
    from distributed import run_subtests

    return run_subtests(run_loop_cell, cells, rank, world)


# ------------------------------------------------------------------------------------------- the Trainer

def trainer_config(cell: Cell) -> dict:
    """The DeepSpeed config the Trainer gets: a framework's file as shipped, or the cell's axes with
    transformers' "auto" everywhere it fills one."""
    if cell.config is not None:
        return json.loads((CONFIGS / f"{cell.config}.json").read_text())
    zero = {"stage": cell.stage, "reduce_bucket_size": "auto"}
    if cell.stage == 3:
        sizes = stage3_sizes(cell.unit)
        zero.update({k: sizes[k] for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")})
    if cell.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if cell.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}


def launch_trainer_cells(cells: list[Cell], workdir: Path, *, timeout: int = 900) -> dict:
    """Run the Trainer cells in one 2-process launch (compat venv: ``deepspeed`` is shardwise's package) and
    their one-process references (the same Trainer script, no DeepSpeed, the whole batch) in one process."""
    from compat_venv import compat_venv, venv_env

    venv = compat_venv()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "cells.json"
    spec.write_text(json.dumps([dict(asdict(c), name=c.name, ds=trainer_config(c)) for c in cells]))
    python = str(venv / "bin" / "python")
    runs = {}
    for mode, cmd in (("reference", [python, str(TRAINER_SCRIPT), "--reference"]),
                      ("shardwise", [python, "-m", "shardwise", "run", "--num_gpus", "2", str(TRAINER_SCRIPT)])):
        report = workdir / f"{mode}.json"
        proc = subprocess.run([*cmd, "--cells", str(spec), "--out", str(workdir / mode), "--report", str(report)],
                              env=venv_env(venv), cwd=workdir, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{mode} Trainer run failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n"
                                 f"{proc.stderr[-8000:]}")
        runs[mode] = json.loads(report.read_text())
    return runs


def check_trainer_cell(cell: Cell, runs: dict) -> None:
    got, ref = runs["shardwise"][cell.name], runs["reference"][cell.name]
    if "error" in got:
        raise AssertionError(f"{cell.name}: {got['error']}")
    assert got["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine", (cell.name, got["engine"])  # shardwise's Engine, DeepSpeed's name
    assert got["steps"] == ref["steps"] == STEPS, cell.name
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=RTOL, atol=0,
                               msg=lambda m: f"{cell.name}: {m}")
    assert set(got["params"]) == set(ref["params"]), cell.name
    for n, v in ref["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][n]), torch.tensor(v), rtol=0, atol=PARAM_TOL,
                                   msg=lambda m: f"{cell.name} {n}: {m}")


# ------------------------------------------------------------------------------------------- command line

def select(cells: list[Cell], filters: list[str]) -> list[Cell]:
    return [c for c in cells if all(f in c.name for f in filters)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("filters", nargs="*", help="run the cells whose name contains every one of these")
    p.add_argument("--suite", action="store_true", help="only the subset tests/test_finetune_matrix.py runs")
    p.add_argument("--list", action="store_true", help="print the selected cells' names and stop")
    p.add_argument("--workdir", default="finetune-matrix-out")
    p.add_argument("--timeout", type=int, default=3600)
    a = p.parse_args(argv)
    cells = select(suite_cells() if a.suite else all_cells(), a.filters)
    if a.list:
        print("\n".join(c.name for c in cells))
        print(f"{len(cells)} cells", file=sys.stderr)
        return 0
    sys.path.insert(0, str(HERE))
    from distributed import run_distributed

    failed = []
    loop = [c for c in cells if c.api == "loop"]
    for c in loop:  # (one cell per group: a failure names its cell and the rest go on)
        try:
            run_distributed(loop_body, 2, args=([c],), timeout=a.timeout)
            print(f"ok    {c.name}", flush=True)
        except AssertionError as exc:
            failed.append(c.name)
            print(f"FAIL  {c.name}\n{exc}", flush=True)
    trainer = [c for c in cells if c.api == "trainer"]
    if trainer:
        runs = launch_trainer_cells(trainer, Path(a.workdir), timeout=a.timeout)
        for c in trainer:
            try:
                check_trainer_cell(c, runs)
                print(f"ok    {c.name}", flush=True)
            except AssertionError as exc:
                failed.append(c.name)
                print(f"FAIL  {c.name}\n{exc}", flush=True)
    print(f"{len(cells) - len(failed)} of {len(cells)} cells match one process", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
