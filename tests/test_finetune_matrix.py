"""The fine-tuning set-ups people run, each against one process (tests/finetune_matrix.py has the axes,
the whole cartesian matrix as a script, and which subset runs here):

* plain loops over ``shardwise.initialize``: ZeRO 0-3 x full fine-tuning / LoRA / LoRA with
  ``modules_to_save`` x no / reentrant / non-reentrant / ``shardwise.checkpointing`` checkpointing x
  ZeRO-3 unit sizes (transformers' "auto", tiny, larger than the model), with and without CPU offload and
  gradient accumulation, on models with as many key/value heads as query heads, grouped ones, and tied
  embeddings; every cell changes the loss in place (``loss *= world``, as the Trainer does), matches one
  process's losses to rtol 1e-6 and its trained parameters to 1e-4, and at ZeRO-3 ends every step with
  every unit released;
* the Hugging Face ``Trainer`` through the compatibility package with configs as fine-tuning frameworks
  ship them ("auto" sizes filled by transformers, CPU offload), against the same Trainer in one process.

Both ZeRO-3 crashes are among the cells: LoRA with grouped key/value heads at the "auto" unit size (a
peft ``lora.Linear`` is one unit, and its frozen weight was released before its input's gradient was
computed), and a unit larger than the model (the loss came back as a view that may not change in place).
"""
from __future__ import annotations

import pytest

from distributed import run_distributed
from finetune_matrix import check_trainer_cell, launch_trainer_cells, loop_body, suite_cells, trainer_suite_cells

pytest.importorskip("peft")


def test_plain_loop_cells_match_one_process():
    cells = [c for c in suite_cells() if c.api == "loop"]
    ranks = run_distributed(loop_body, 2, args=(cells,), timeout=900)
    for cell, result in zip(cells, ranks[0]):
        assert len(result["losses"]) == 2, cell
        if cell.stage == 3:
            assert result["memory"]["gathered"] == [], cell


def test_trainer_with_framework_configs_matches_one_process(tmp_path):
    cells = trainer_suite_cells()
    runs = launch_trainer_cells(cells, tmp_path)
    for cell in cells:
        check_trainer_cell(cell, runs)
