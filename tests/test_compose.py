"""Parallel axes compose on a tiny Hugging Face Llama: AutoTP tensor 2 x data 2 at ZeRO-3 (with and without
CPU offload of parameters and optimizer) trains with the per-step losses and final weights of one process
on the whole batch (fp32, relative 1e-6). One 4-rank spawn runs every case.

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
    {"name": "autotp tp2 x dp2 ZeRO-3", "tp": 2, "zero": {"stage": 3}},
    {"name": "autotp tp2 x dp2 ZeRO-3 cpu offload", "tp": 2,
     "zero": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
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
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


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
            "tensor_parallel": {"autotp_size": case["tp"]}}


def _whole_weights(engine) -> dict:
    """Every parameter whole (gathered over the data axis, then the tensor pieces joined)."""
    from shardwise.checkpoint import tensor_parallel as tpc

    state = engine.strategy.module_state_dict(engine.module)
    view = tpc.view_of(engine)
    return tpc.gather_state_dict(state, view) if view.active else state


def _train(case: dict, rank: int, world: int, path: str):
    import shardwise

    model = _load(path)
    dp = world // case["tp"]
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(case, dp))
    grid = engine.grid
    assert grid.get_tensor_model_parallel_world_size() == case["tp"] and engine.dp_world_size == dp
    d, per = grid.get_data_parallel_rank(), ROWS // dp
    losses = []
    for step in range(STEPS):
        ids = _batch(step)[d * per:(d + 1) * per]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=grid.get_data_parallel_group())
        losses.append(mean.item() / dp)
    breakdown = engine.memory_breakdown()
    return losses, _whole_weights(engine), breakdown


def _body(rank: int, world: int, path: str):
    return run_subtests(lambda case: _train(case, rank, world, path), CASES)


def test_tensor_parallel_composes_with_zero3_on_a_hf_llama(tmp_path):
    path = _save_llama(tmp_path / "llama")
    ref_losses, ref_params = _reference(path)
    results = run_distributed(_body, 4, args=(path,), timeout=300)
    for i, case in enumerate(CASES):
        for rank, per_case in enumerate(results):
            losses, params, breakdown = per_case[i]
            torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0, msg=f"{case['name']} rank {rank}")
            # model states per rank: this tensor rank's piece (projections halved, embeddings and norms whole),
            # partitioned over the 2 data ranks: fp32 weights + gradients + SGD momentum (+ an fp32 copy the
            # optimizer steps where there is one) = 12 (16) bytes / 2 ranks
            piece = sum(p.numel() // (2 if "_proj" in n else 1) for n, p in ref_params.items())
            assert (breakdown.stage, breakdown.dp_world_size, breakdown.tensor_parallel_size) == (3, 2, 2)
            assert breakdown.model_num_params == sum(p.numel() for p in ref_params.values())
            per_param = 16 if breakdown.master_params else 12
            assert breakdown.num_params == piece and breakdown.theoretical == per_param * piece // 2
            assert breakdown.theoretical <= breakdown.total <= 1.01 * breakdown.theoretical, breakdown
            if rank == 0:
                assert params.keys() == ref_params.keys()
                for k, want in ref_params.items():
                    torch.testing.assert_close(params[k], want, rtol=1e-6, atol=1e-7,
                                               msg=lambda m, k=k: f"{case['name']} {k}: {m}")
