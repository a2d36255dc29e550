"""Ulysses sequence parallelism (shardwise.runtime.sequence_parallel): a tiny random Llama with grouped
key/value heads trained at sequence parallel 2 (2 ranks) and 2 x data parallel 2 (4 ranks), ZeRO 1 and 3,
gives the losses and weights of one process training on the whole sequences; the data-loader adapter
hands every token to exactly one rank; a ZeRO-3 checkpoint saved at sp 2 x dp 2 resumes bit for bit,
consolidates to the trained weights and loads in one process without sequence parallelism."""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_distributed, run_subtests

STEPS = 4
TWO_RANK_CASES = [(1, "gqa"), (2, "gqa"), (3, "gqa"), (0, "mqa")]  # (ZeRO stage, model)
LR = 1e-2
VOCAB = 97


def _save_llama(path, kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_models")
    return {"gqa": _save_llama(root / "gqa", kv_heads=2), "mqa": _save_llama(root / "mqa", kv_heads=1)}


def _sample(seed: int, length: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100  # a "prompt" that is not trained on: shards get unequal token counts
    return {"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": labels}


def _rank_data(world: int, sp: int) -> list[list[dict]]:
    """What each rank's own loader yields: every step's sample of an sp group has its own length."""
    per_rank = STEPS // sp
    lengths = [16, 8, 12, 20]
    return [[_sample(100 * g + k, lengths[(g % sp + k * sp) % len(lengths)]) for k in range(per_rank)]
            for g in range(world)]


def _step_samples(data: list[list[dict]], sp: int, dp: int) -> list[list[dict]]:
    """The samples each optimizer step trains on: replica d at micro-step k*sp + j takes sp rank j's k-th."""
    return [[data[d * sp + j][k] for d in range(dp)] for k in range(STEPS // sp) for j in range(sp)]


def _reference(path: str, steps: list[list[dict]]):
    """One process, whole sequences, the same optimizer and clipping."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for samples in steps:
        loss = sum(model(input_ids=s["input_ids"], position_ids=s["position_ids"], labels=s["labels"]).loss
                   for s in samples) / len(samples)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(loss.item())
    return (losses, norms), {n: p.detach().clone() for n, p in model.named_parameters()}


def _sp_engine(stage: int, path: str, world: int):
    import shardwise
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=2,
        micro_batch_size=1, seq_length_is_variable=True, disable_in_eval=True)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
              "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=model, config=config, mpu=mpu)
    assert engine.dp_world_size == world // 2 and engine.train_batch_size() == world // 2
    return engine


def _sp_batches(engine, data_of_rank) -> list[dict]:
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    sp_state = engine.grid
    return list(UlyssesSPDataLoaderAdapter(data_of_rank, sp_rank=sp_state.get_sequence_parallel_rank(),
                                           sp_group=sp_state.get_sequence_parallel_group(),
                                           sp_world_size=sp_state.get_sequence_parallel_world_size(),
                                           device=engine.device))


def _sp_train(engine, batches: list[dict], world: int):
    sp_state = engine.grid
    sp_group = sp_state.get_sequence_parallel_group()
    sp_size = sp_state.get_sequence_parallel_world_size()
    losses, norms = [], []
    for batch in batches:
        batch = dict(batch)
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits
        loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB)
        good = (shift_labels != -100).view(-1).sum()
        if world == sp_size:
            # DeepSpeed's documented combination: per-shard loss weighted by its valid tokens, differentiable gather
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            good_per_rank = torch.distributed.nn.functional.all_gather(good, group=sp_group)
            loss = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_size)) / sum(good_per_rank)
        else:
            # torch's all_gather backward fails on gloo for a group smaller than the world (it scatters from a
            # group rank as if it were a global one): the same sum through a differentiable all-reduce
            total = torch.distributed.nn.functional.all_reduce(loss * good, group=sp_group)
            loss = total / torch.distributed.nn.functional.all_reduce(good, group=sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())  # before clipping: Adam and clipping would hide a scale error
    return losses, norms


def _full_params(engine) -> dict:
    from shardwise.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _train_sp(case, rank: int, world: int, paths: dict, data):
    stage, model_key = case
    engine = _sp_engine(stage, paths[model_key], world)
    return _sp_train(engine, _sp_batches(engine, data[rank]), world), _full_params(engine)


def _sp_checkpoint(rank: int, world: int, path: str, data, ckpt: str):
    """ZeRO-3 over sp 2 x dp 2: save after two steps; a fresh engine that loads it repeats the last two
    steps bit for bit; the checkpoint's consolidated fp32 weights are the trained ones."""
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = _sp_engine(3, path, world)
    batches = _sp_batches(engine, data[rank])
    _sp_train(engine, batches[:2], world)
    engine.save_checkpoint(ckpt, tag="half")
    want = _sp_train(engine, batches[2:], world)
    want_params = _full_params(engine)
    fresh = _sp_engine(3, path, world)
    fresh.load_checkpoint(ckpt, tag="half")
    got = _sp_train(fresh, batches[2:], world)
    assert got == want, (got, want)
    got_params = _full_params(fresh)
    assert all(torch.equal(got_params[n], want_params[n]) for n in want_params)
    fresh.save_checkpoint(ckpt, tag="end")
    torch.distributed.barrier()
    if rank == 0:
        saved = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="end")
        assert set(saved) == set(want_params), sorted(set(saved) ^ set(want_params))
        for name, p in want_params.items():
            assert torch.equal(saved[name].view_as(p), p), name
    return "resumed", want_params


def _load_on_one_rank(rank: int, world: int, path: str, ckpt: str):
    """The sp 2 x dp 2 checkpoint in a plain one-process ZeRO-3 engine (no sequence parallelism)."""
    import shardwise
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    engine.load_checkpoint(ckpt, tag="end")
    return _full_params(engine)


def _adapter_shards(rank: int, world: int):
    """The adapter's shards of two rounds of batches of different lengths (8 and 12 tokens per rank)."""
    from shardwise.runtime.sequence_parallel.groups import registered_grid
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    sp_state = registered_grid()
    mine = [dict(_sample(10 + rank, 8 + 4 * rank), tag=f"r{rank}"), dict(_sample(20 + rank, 4), tag=f"s{rank}")]
    dl = UlyssesSPDataLoaderAdapter(mine, sp_rank=sp_state.get_sequence_parallel_rank(),
                                    sp_group=sp_state.get_sequence_parallel_group(),
                                    sp_world_size=sp_state.get_sequence_parallel_world_size(), device="cpu")
    assert len(dl) == 4
    return list(dl)


def _eval_full_sequence(path: str):
    """disable_in_eval: in eval mode the model runs on a whole sequence without exchanging anything."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    s = _sample(7, 10)  # 10 tokens: not even divisible by the group size
    with torch.no_grad():
        return model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits


def _flex_forward(rank: int, path: str):
    """flex_attention (forward only: torch has no flex_attention backward on the CPU): the model's BlockMask,
    built for the local shard, is rebuilt for the whole sequence."""
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=path, core_attn_implementation="flex_attention",
                                                    sequence_parallel_size=2, micro_batch_size=1)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flex_attention").train()
    s = _sample(5, 256)
    lo, hi = 128 * rank, 128 * (rank + 1)
    with torch.no_grad():
        return model(input_ids=s["input_ids"][:, lo:hi], position_ids=s["position_ids"][:, lo:hi]).logits


def _causal_attention(q, k, v):  # [seq, batch, heads, dim] in and out, as Megatron lays them out
    out = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3)


def _qkv():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 2, 4, 8, generator=g) for _ in range(3)] + [torch.randn(8, 2, 4, 8, generator=g)]


def _distributed_attention(rank: int):
    """DeepSpeed's older shardwise.sequence.layer.DistributedAttention: this rank's output and input gradients."""
    from shardwise.runtime.sequence_parallel.groups import registered_grid
    from shardwise.sequence.layer import DistributedAttention

    sp_state = registered_grid()

    attn = DistributedAttention(_causal_attention, sp_state.get_sequence_parallel_group(), scatter_idx=2, gather_idx=0)
    *qkv, w = _qkv()
    mine = [t[4 * rank:4 * (rank + 1)].clone().requires_grad_() for t in qkv]
    out = attn(*mine, batch_dim_idx=1)
    (out * w[4 * rank:4 * (rank + 1)]).sum().backward()
    return out.detach(), [t.grad for t in mine]


def _two_ranks(rank: int, world: int, paths: dict, data):
    from shardwise.runtime.sequence_parallel.groups import sequence_parallel_grid

    sequence_parallel_grid(2)
    shards = _adapter_shards(rank, world)
    trained = run_subtests(_train_sp, TWO_RANK_CASES, rank, world, paths, data)
    return (shards, trained, _eval_full_sequence(paths["gqa"]), _flex_forward(rank, paths["gqa"]),
            _distributed_attention(rank))


def _four_ranks(rank: int, world: int, paths: dict, data, ckpt: str):
    trained = run_subtests(_train_sp, [(1, "gqa"), (3, "gqa")], rank, world, paths, data)
    return trained, _sp_checkpoint(rank, world, paths["gqa"], data, ckpt)


def _assert_matches(results, ref, dp: int, label: str):
    (ref_losses, ref_norms), ref_params = ref
    sp_losses = [sum(results[d * 2][0][0][s] for d in range(dp)) / dp for s in range(STEPS)]
    for s, (a, b) in enumerate(zip(sp_losses, ref_losses)):
        assert math.isclose(a, b, rel_tol=1e-6), f"{label}: step {s} loss {a} vs one process {b}"
    for r, ((_, norms), _) in enumerate(results):
        for s, (a, b) in enumerate(zip(norms, ref_norms)):
            assert math.isclose(a, b, rel_tol=1e-5), f"{label}, rank {r}: step {s} gradient norm {a} vs {b}"
    for r, (losses, params) in enumerate(results):
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label}, rank {r}, {name}: {m}")


def _check_adapter(shards_per_rank):
    for rnd in range(2):  # one round per batch each rank's loader yields
        for src in range(2):  # the sample that came from sp rank src
            full = _sample(10 * (rnd + 1) + src, [8 + 4 * src, 4][rnd])
            got = [shards_per_rank[r][2 * rnd + src] for r in range(2)]
            assert all(g["tag"] == ("r" if rnd == 0 else "s") + str(src) for g in got)
            assert set(got[0]) == {"input_ids", "position_ids", "shift_labels", "tag"}
            ids = torch.cat([g["input_ids"] for g in got], dim=1)
            assert torch.equal(ids, full["input_ids"]), "every token goes to exactly one rank, in order"
            assert got[0]["input_ids"].shape[1] == got[1]["input_ids"].shape[1]
            assert torch.equal(torch.cat([g["position_ids"] for g in got], dim=1), full["position_ids"])
            shifted = torch.cat([full["labels"][:, 1:], torch.tensor([[-100]])], dim=1)
            assert torch.equal(torch.cat([g["shift_labels"] for g in got], dim=1), shifted)


def test_sequence_parallel_two_ranks_matches_one_process(models):
    data = _rank_data(2, 2)
    steps = _step_samples(data, 2, 1)
    ref = {k: _reference(p, steps) for k, p in models.items()}
    results = run_distributed(_two_ranks, 2, args=(models, data), timeout=240)
    shards, trained, eval_logits, flex, dist_attn = zip(*results)
    _check_adapter(shards)
    by_case = list(zip(*trained))  # per case: the two ranks' (losses, params)
    for (stage, key), results in zip(TWO_RANK_CASES, by_case):
        _assert_matches(results, ref[key], dp=1, label=f"sp 2, ZeRO {stage}, {key}")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(models["gqa"], attn_implementation="sdpa").eval()
    s = _sample(7, 10)
    with torch.no_grad():
        want = plain(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
    for logits in eval_logits:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    flex_model = AutoModelForCausalLM.from_pretrained(models["gqa"], attn_implementation="flex_attention")
    s = _sample(5, 256)
    with torch.no_grad():
        want = flex_model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
    torch.testing.assert_close(torch.cat(flex, dim=1), want, rtol=1e-5, atol=1e-5)
    *qkv, w = _qkv()
    qkv = [t.requires_grad_() for t in qkv]
    out = _causal_attention(*qkv)
    (out * w).sum().backward()
    torch.testing.assert_close(torch.cat([o for o, _ in dist_attn]), out.detach(), rtol=1e-5, atol=1e-6)
    for i, t in enumerate(qkv):
        torch.testing.assert_close(torch.cat([g[i] for _, g in dist_attn]), t.grad, rtol=1e-5, atol=1e-6)


def test_sequence_parallel_two_by_data_parallel_two_matches_one_process_and_resumes(models, tmp_path):
    data = _rank_data(4, 2)
    ref = _reference(models["gqa"], _step_samples(data, 2, 2))
    results = run_distributed(_four_ranks, 4, args=(models, data, str(tmp_path / "ckpt")), timeout=300)
    for i, stage in enumerate([1, 3]):
        _assert_matches([r[0][i] for r in results], ref, dp=2, label=f"sp 2 x dp 2, ZeRO {stage}")
    assert [r[1][0] for r in results] == ["resumed"] * 4
    trained = results[0][1][1]
    loaded = run_distributed(_load_on_one_rank, 1, args=(models["gqa"], str(tmp_path / "ckpt")), timeout=120)[0]
    for name, p in trained.items():
        assert torch.equal(loaded[name], p), f"{name}: the sp 2 x dp 2 checkpoint loads at 1 rank"


def test_sequence_parallel_size_without_groups_says_what_to_call():
    import shardwise
    from models import base_config, make_model

    with pytest.raises(ValueError, match="sequence_parallel_size is 2.*register_with_transformers"):
        shardwise.initialize(model=make_model(), config=base_config(sequence_parallel_size=2))
