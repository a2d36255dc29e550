"""Scripts written the DeepSpeed way, run under ``import shardwise as deepspeed`` on 2 processes:

* a client script at ZeRO-3 that goes through the API surface real scripts use (accelerator,
  ``DeepSpeedCPUAdam`` as client optimizer, engine accessors, ``ds_*`` parameter attributes,
  ``GatheredParameters``, ``safe_get/set_full_*``, comm, save/load, ``zero_to_fp32``);
* DeepSpeed-Chat's step-1 (SFT) loop on a tiny local Llama: optimizer chosen by the offload flag,
  a transformers scheduler, ``tput_timer``, and ``save_zero_three_model``'s gathering by ``ds_id``;
* the ``zero_to_fp32.py`` written into the checkpoint folder, run in a venv holding only torch and
  safetensors, reproduces the trained weights.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed, run_subtests

REPO = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.block = Block()
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.block(torch.tanh(self.inp(x))))


def _client_script(rank, world_size, save_dir):
    """Written as a DeepSpeed user writes it; every check names the API it exercises."""
    import shardwise as deepspeed
    from shardwise import comm as dist
    from shardwise.accelerator import get_accelerator
    from shardwise.ops.adam import DeepSpeedCPUAdam
    from shardwise.runtime.utils import see_memory_usage, set_random_seed
    from shardwise.zero import GatheredParameters, ZeroParamStatus
    from shardwise.utils import (log_dist, safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state, set_z3_leaf_modules)
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.communication_backend_name() == "gloo"
    assert acc.current_device_name() == "cpu" and acc.current_device() == rank
    set_random_seed(1234)
    model = Net()
    assert set_z3_leaf_modules(model, [Block]) == [model.block]
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01, adamw_mode=True)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50,
                              "stage3_gather_16bit_weights_on_model_save": True,
                              "offload_optimizer": {"device": "cpu"}},
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                             model_parameters=model.parameters(), config=config)
    log_dist("engine ready", ranks=[0])
    see_memory_usage("after initialize", force=True)

    # -- engine accessors --------------------------------------------------------------------
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and opt is optimizer
    assert engine.zero_optimization_stage() == 3 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_cpu_offload()
    assert engine.gradient_clipping() == 1.0 and engine.optimizer_name() == "DeepSpeedCPUAdam"
    assert engine.get_data_parallel_rank() == rank and engine.get_data_parallel_world_size() == world_size
    assert engine.zero_gather_16bit_weights_on_model_save()
    assert engine.train_batch_size() == 2 * 2 * world_size

    # -- ZeRO-3 parameter attributes, DeepSpeed's meaning --------------------------------------
    params = dict(engine.module.named_parameters())
    ids = [p.ds_id for p in params.values()]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    for name, p in params.items():
        full = {"inp.weight": (10, 6), "inp.bias": (10,), "head.weight": (3, 10), "head.bias": (3,)}.get(
            name, (10, 10) if name.endswith("weight") else (10,))
        assert tuple(p.ds_shape) == full and p.ds_numel == math.prod(full), name
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, (name, p.ds_status)
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / world_size), name

    # the leaf Block (220 elements, more than a 50-element unit) is gathered as one unit all the same
    from shardwise.zero.partitioned_param import unit_of

    assert unit_of(params["block.a.weight"]) is unit_of(params["block.b.bias"])
    assert unit_of(params["inp.weight"]) is not unit_of(params["block.a.weight"])

    # -- train: 4 optimizer steps of 2 micro-batches each -----------------------------------------
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(8 * world_size)]
    applied = []
    for i in range(8):
        x, y = data[i * world_size + rank]
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True] * 4
    assert engine.global_steps == 4 and engine.tput_timer.avg_samples_per_sec() > 0

    # -- GatheredParameters with a modifier rank ------------------------------------------------
    w = params["head.weight"]
    with GatheredParameters([w], modifier_rank=0):
        assert w.ds_status == ZeroParamStatus.AVAILABLE and tuple(w.shape) == (3, 10)
        if rank == 0:
            w.data.fill_(0.5)
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert torch.equal(safe_get_full_fp32_param(w), torch.full((3, 10), 0.5))
    safe_set_full_fp32_param(params["head.bias"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(safe_get_full_fp32_param(params["head.bias"]), torch.tensor([1.0, 2.0, 3.0]))
    safe_set_full_optimizer_state(params["head.bias"], torch.tensor([0.1, 0.2, 0.3]), "exp_avg")
    assert torch.allclose(safe_get_full_optimizer_state(params["head.bias"], "exp_avg"), torch.tensor([0.1, 0.2, 0.3]))

    # -- comm ---------------------------------------------------------------------------------------
    t = torch.tensor([float(rank + 1)])
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    assert [x.item() for x in gathered] == [1.0, 2.0]
    out = torch.zeros(world_size)
    dist.all_gather_into_tensor(out, t)
    assert out.tolist() == [1.0, 2.0]
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.tensor([1.0, 10.0]) * (rank + 1))
    assert rs.item() == [3.0, 30.0][rank]
    a2a = torch.zeros(2)
    dist.all_to_all_single(a2a, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    assert a2a.tolist() == [float(rank), 10.0 + rank]
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=peer)
        box = torch.zeros(1)
        dist.irecv(box, src=peer).wait()
        assert box.item() == 43.0
    else:
        box = torch.zeros(1)
        dist.recv(box, src=peer)
        assert box.item() == 42.0
        dist.isend(torch.tensor([43.0]), dst=peer).wait()
    group = dist.new_group([0, 1])
    dist.barrier(group=group)
    assert dist.get_world_group() is not None and dist.get_local_rank() == rank

    # -- whole-model state and checkpoints ---------------------------------------------------------
    full = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    sd16 = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        assert set(sd16) == set(full) and all(torch.equal(sd16[k].float(), full[k]) for k in full)
    else:
        assert sd16 is None
    assert engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    assert (Path(save_dir) / "latest").read_text().strip() == "global_step4"  # DeepSpeed's tag default
    assert (Path(save_dir) / "zero_to_fp32.py").is_file()
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert set(state) == set(engine.module.state_dict()) and all(torch.equal(state[k], full[k]) for k in full)
    lazy = get_fp32_state_dict_from_zero_checkpoint(save_dir, lazy_mode=True)
    assert torch.equal(lazy["inp.weight"].contiguous(), full["inp.weight"])

    # load back, with a custom load function that doubles every weight it copies
    def double(src, dst):
        with torch.no_grad():
            for name, p in dst.named_parameters():
                p.copy_(src[name].float() * 2)

    path, client = engine.load_checkpoint(save_dir, custom_load_fn=double)
    assert client == {"epoch": 3} and path.endswith("global_step4")
    for n, p in params.items():
        assert torch.allclose(safe_get_full_fp32_param(p), full[n] * 2), n

    engine.set_train_batch_size(4 * 2 * world_size)
    assert engine.gradient_accumulation_steps() == 4
    engine.destroy()
    return {k: v.tolist() for k, v in full.items()}


# ------------------------------------------------------------------------ DeepSpeed-Chat step 1

def _get_train_ds_config(offload, stage):
    """DeepSpeed-Chat's utils/ds_utils.py:get_train_ds_config, trimmed of its tensorboard paths."""
    device = "cpu" if offload else "none"
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                              "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": False, "loss_scale_window": 100},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True,
                          "tp_gather_partition_size": 8},
    }


def _get_optimizer_grouped_parameters(model, weight_decay,
                                      no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                          "norm.weight", "ln_f.weight")):
    return [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": 0.0},
    ]


def _z3_params_to_fetch(param_list):
    from shardwise.zero import ZeroParamStatus

    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def _save_zero_three_model(model_ema, global_rank, zero_stage=0):
    """DeepSpeed-Chat's utils.save_zero_three_model, returning the state dict instead of writing it."""
    import shardwise as deepspeed

    zero_stage_3 = zero_stage == 3
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p
    return output_state_dict


def _ds_chat_step1(offload, rank, world_size):
    import argparse
    import time

    from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

    import shardwise as deepspeed
    from shardwise.accelerator import get_accelerator
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from shardwise.utils import safe_get_full_fp32_param

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args([f"--local_rank={rank}"])
    device = torch.device(get_accelerator().device_name())
    args.global_rank = torch.distributed.get_rank()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    groups = _get_optimizer_grouped_parameters(model, 0.1)
    AdamOptimizer = DeepSpeedCPUAdam if offload else FusedAdam  # noqa: N806 - DS-Chat's name
    optimizer = AdamOptimizer(groups, lr=1e-3, betas=(0.9, 0.95))
    lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4)
    ds_config = _get_train_ds_config(offload, stage=3)
    ds_config["train_micro_batch_size_per_gpu"] = 2
    ds_config["train_batch_size"] = 2 * world_size * 2
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(8 * world_size)]
    losses = []
    model.train()
    for step in range(8):
        start = time.time()
        ids = batches[step * world_size + rank].to(device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        outputs = model(**batch, use_cache=False)
        loss = outputs.loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        assert time.time() - start >= 0
    assert model.global_steps == 4 and lr_scheduler.get_last_lr()[0] < 1e-3  # cosine decay ran
    assert model.tput_timer.avg_samples_per_sec() > 0
    model.eval()
    with torch.no_grad():
        ppl = math.exp(model(input_ids=batches[0], labels=batches[0], use_cache=False).loss.item())
    get_accelerator().empty_cache()
    saved = _save_zero_three_model(model, args.global_rank, zero_stage=3)
    full = {n: safe_get_full_fp32_param(p) for n, p in model.module.named_parameters()}
    if rank == 0:
        assert set(saved) == set(full)
        for k, v in saved.items():
            assert tuple(v.shape) == tuple(full[k].shape) and torch.equal(v.float(), full[k]), k
    else:
        assert saved == {}
    return {"losses": losses, "ppl": ppl, "optimizer": type(optimizer).__name__}


def _chat_body(rank, world_size):
    return run_subtests(_ds_chat_step1, [False, True], rank, world_size)


def _coalesced_reduce_scatter(rank, world_size):
    """The compat package's ``reduce_scatter_coalesced`` (DeepSpeed's helper) against an all-reduce: each
    rank gets its ceil(numel / world) part of every averaged tensor, the last parts shorter or empty."""
    sys.path.insert(0, str(REPO / "compat" / "deepspeed"))
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    import shardwise.comm as dist
    inputs = [(rank + 1) * torch.arange(n, dtype=torch.half) for n in (6, 3, 1)]
    outs = reduce_scatter_coalesced([t.clone() for t in inputs], dist.get_world_group())
    for t, out in zip(inputs, outs):
        whole = t.float()
        dist.all_reduce(whole)
        part = -(-t.numel() // world_size)
        assert torch.equal(out.float(), (whole / world_size)[rank * part:(rank + 1) * part]), (t, out)
    return [o.numel() for o in outs]


def _scripts_body(rank, world_size, save_dir):
    full = _client_script(rank, world_size, save_dir)
    return {"client": full, "chat": _chat_body(rank, world_size), "coalesced": _coalesced_reduce_scatter(rank, world_size)}


# ----------------------------------------------------------------------------------- the tests

def _venv_python() -> Path:
    """A venv with only torch and safetensors (built once, then reused from the cache folder)."""
    root = Path(os.environ.get("SHARDWISE_TEST_VENV",
                               Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                               / "shardwise-tests" / "venv-torch-safetensors"))
    python = root / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)  # no system site-packages
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                        "safetensors"], check=True, timeout=1800)
    return python


def test_deepspeed_style_scripts_under_two_processes(tmp_path):
    save_dir = tmp_path / "ckpt"
    results = run_distributed(_scripts_body, 2, args=(str(save_dir),), timeout=300)
    assert [r["coalesced"] for r in results] == [[3, 2, 1], [3, 1, 0]]
    client = results[0]["client"]
    assert results[1]["client"] == client  # both ranks saw the same whole weights
    for chat in (results[0]["chat"], results[1]["chat"]):
        assert [c["optimizer"] for c in chat] == ["FusedAdam", "DeepSpeedCPUAdam"]
        for c in chat:
            assert all(math.isfinite(x) for x in c["losses"]) and math.isfinite(c["ppl"])
    # the offload flag changes only where the optimizer runs, not the numbers
    assert results[0]["chat"][0]["losses"] == pytest.approx(results[0]["chat"][1]["losses"], rel=1e-5)

    # zero_to_fp32.py from the checkpoint folder, in a venv holding only torch and safetensors
    python = _venv_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    probe = subprocess.run([str(python), "-c", "import shardwise"], cwd=tmp_path, env=env, capture_output=True)
    assert probe.returncode != 0  # shardwise is not importable there
    for extra, name in (([], "pytorch_model.bin"), (["--safe_serialization"], "model.safetensors")):
        out = tmp_path / f"out{len(extra)}"
        proc = subprocess.run([str(python), str(save_dir / "zero_to_fp32.py"), str(save_dir), str(out), *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if extra:
            from safetensors.torch import load_file

            state = load_file(str(out / name))
        else:
            state = torch.load(out / name, weights_only=True)
        assert set(state) == set(client)
        # the checkpoint holds the weights as they were at save time (before the doubling load)
        for k, v in client.items():
            assert torch.equal(state[k], torch.tensor(v)), k
