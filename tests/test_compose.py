"""Parallel axes compose on a tiny Hugging Face Llama: AutoTP tensor 2 x data 2 at ZeRO-3 (with and without
CPU offload of parameters and optimizer; its save_16bit_model export is whole), and Ulysses sequence 2 x
AutoTP tensor 2 at ZeRO-0, 1 and 3, train with the per-step losses and final weights of one process on the
whole batch (fp32, relative 1e-6). One 4-rank spawn runs every case (the sequence-parallel ones last:
registering Ulysses replaces the process's sdpa attention).

(The reference GPT's compositions, pipe x tensor x data at ZeRO-3 and checkpoints across layouts, are in
tests/test_tensor_parallel.py, next to its one-process reference.)
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed, run_subtests

transformers = pytest.importorskip("transformers")

VOCAB, ROWS, SEQ, STEPS = 96, 4, 8, 3
LR, CLIP = 0.2, 0.5  # SGD (Adam's update hides a uniform gradient scale); the clip acts at every step

CASES = [
    {"name": "autotp tp2 x dp2 ZeRO-3", "tp": 2, "export": True,
     "zero": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
    {"name": "autotp tp2 x dp2 ZeRO-3 cpu offload", "tp": 2,
     "zero": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
    {"name": "ulysses sp2 x autotp tp2 ZeRO-0", "tp": 2, "sp": 2, "zero": {"stage": 0}},
    {"name": "ulysses sp2 x autotp tp2 ZeRO-1", "tp": 2, "sp": 2, "zero": {"stage": 1}},
    {"name": "ulysses sp2 x autotp tp2 ZeRO-3", "tp": 2, "sp": 2, "zero": {"stage": 3}},
]


def _save_llama(path) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF's init leaves norms constant: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return str(path)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(50 + step))


def _reference(path):
    model = _load(path)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # clipping acts: a norm counted wrongly (replicated weights twice) would show
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(case: dict, dp: int) -> dict:
    zero = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500, **case["zero"]}
    return {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}, "zero_optimization": zero,
            "tensor_parallel": {"autotp_size": case["tp"]}, "sequence_parallel_size": case.get("sp", 1)}


def _whole_weights(engine) -> dict:
    """Every parameter whole (gathered over the data axis, then the tensor pieces joined)."""
    from shardwise.checkpoint import tensor_parallel as tpc

    state = engine.strategy.module_state_dict(engine.module)
    view = tpc.view_of(engine)
    return tpc.gather_state_dict(state, view) if view.active else state


def _sequence_loss(engine, ids: torch.Tensor, sp: int) -> torch.Tensor:
    """Ulysses: this rank's slice of every sequence, labels shifted over the whole sequence, and the loss of
    the whole sequence from the slices' token-weighted losses (a differentiable sum over the sequence group)."""
    from torch.distributed.nn.functional import all_reduce

    s, cut = engine.grid.get_sequence_parallel_rank(), ids.shape[1] // sp
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)[:, s * cut:(s + 1) * cut].contiguous()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)[:, s * cut:(s + 1) * cut].contiguous()
    logits = engine(input_ids=ids[:, s * cut:(s + 1) * cut].contiguous(), position_ids=pos).logits
    loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift, vocab_size=VOCAB)
    good = (shift != -100).sum()
    group = engine.grid.get_sequence_parallel_group()
    return all_reduce(loss * good, group=group) / all_reduce(good, group=group)


def _engine(case: dict, world: int, path: str):
    import shardwise
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    sp = case.get("sp", 1)
    config = _config(case, world // (case["tp"] * sp))
    mpu = None
    if sp > 1:  # the tensor size comes from the config: the groups are laid out data x sequence x tensor
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=config["train_micro_batch_size_per_gpu"], config=config)
    model = _load(path)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine


def _train(case: dict, rank: int, world: int, path: str, out: str):
    engine = _engine(case, world, path)
    grid, sp = engine.grid, case.get("sp", 1)
    dp = world // (case["tp"] * sp)
    assert grid.get_tensor_model_parallel_world_size() == case["tp"] and engine.dp_world_size == dp
    assert grid.get_sequence_parallel_world_size() == sp
    d, per = grid.get_data_parallel_rank(), ROWS // dp
    losses = []
    for step in range(STEPS):
        ids = _batch(step)[d * per:(d + 1) * per]
        loss = _sequence_loss(engine, ids, sp) if sp > 1 else engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=grid.get_data_parallel_group())
        losses.append(mean.item() / dp)
    breakdown = engine.memory_breakdown()
    if case.get("export"):  # whole Hugging Face weights from the tensor pieces of ZeRO-3 shards
        assert engine.save_16bit_model(out)
    return losses, _whole_weights(engine), breakdown


def _body(rank: int, world: int, path: str, out: str):
    return run_subtests(lambda case: _train(case, rank, world, path, out), CASES)


def test_tensor_parallel_composes_with_zero3_and_sequence_parallelism_on_a_hf_llama(tmp_path):
    path = _save_llama(tmp_path / "llama")
    ref_losses, ref_params = _reference(path)
    results = run_distributed(_body, 4, args=(path, str(tmp_path / "hf")), timeout=300)
    for i, case in enumerate(CASES):
        for rank, per_case in enumerate(results):
            losses, params, breakdown = per_case[i]
            torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0, msg=f"{case['name']} rank {rank}")
            if rank == 0:
                assert params.keys() == ref_params.keys()
                for k, want in ref_params.items():
                    torch.testing.assert_close(params[k], want, rtol=1e-6, atol=1e-7,
                                               msg=lambda m, k=k: f"{case['name']} {k}: {m}")
            if case["zero"]["stage"] == 3 and case.get("sp", 1) == 1:
                _check_breakdown(breakdown, ref_params)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == ref_params.keys()
    for k, want in ref_params.items():
        torch.testing.assert_close(exported[k], want, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"export {k}: {m}")


def _check_breakdown(breakdown, ref_params):
    """Model states per rank: this tensor rank's piece (projections and the untied LM head halved, embeddings
    and norms whole), partitioned over the 2 data ranks: fp32 weights + gradients + SGD momentum (+ an fp32 copy
    the optimizer steps where there is one) = 12 (16) bytes / 2 ranks."""
    piece = sum(p.numel() // (2 if "_proj" in n or n == "lm_head.weight" else 1) for n, p in ref_params.items())
    assert (breakdown.stage, breakdown.dp_world_size, breakdown.tensor_parallel_size) == (3, 2, 2)
    assert breakdown.model_num_params == sum(p.numel() for p in ref_params.values())
    per_param = 16 if breakdown.master_params else 12
    assert breakdown.num_params == piece and breakdown.theoretical == per_param * piece // 2
    assert breakdown.theoretical <= breakdown.total <= 1.01 * breakdown.theoretical, breakdown


def test_register_with_transformers_learns_the_tensor_size_and_names_a_mismatch():
    from shardwise.runtime.plan import _REGISTERED, _agree
    from shardwise.runtime.sequence_parallel.ulysses_sp import _tensor_size

    assert _tensor_size(None, None) == 1
    assert _tensor_size(None, {"tensor_parallel": {"autotp_size": 2}}) == 2
    assert _tensor_size(2, {"train_batch_size": 8}) == 2
    with pytest.raises(ValueError, match=r"tensor-parallel sizes disagree: tensor_parallel_size = 2, the config's "
                                         r"tensor_parallel.autotp_size = 4"):
        _tensor_size(2, {"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(ValueError, match=r"tensor_parallel.autotp_size is 2 but the groups register_with_transformers "
                                         r"made has tensor size 1: pass register_with_transformers\(\.\.\., "
                                         r"tensor_parallel_size=2\)"):
        _agree("tensor_parallel.autotp_size", 2, _REGISTERED, 1)
