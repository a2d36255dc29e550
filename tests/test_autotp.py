"""AutoTP: Hugging Face models sharded by module role (tensor_parallel.autotp_size, tp_model_init,
init_inference), against the same model in one process.

Tiny models are built from a config with random weights, saved to a temporary directory and loaded
with ``from_pretrained`` (no hub). One 2-rank spawn checks the sharded forward/backward and greedy
generation of Llama (grouped key/value heads), Qwen3 (per-head q/k norms) and GPT-2 (fused c_attn);
another trains through ``initialize`` at ZeRO 1 and 2 and round-trips a checkpoint to tp 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from distributed import run_distributed, run_subtests

COMPAT = str(Path(__file__).resolve().parents[1] / "compat" / "deepspeed")

transformers = pytest.importorskip("transformers")

VOCAB = 96


def tiny_config(kind: str, **over):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64, tie_word_embeddings=True)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(kind)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def save_tiny(kind: str, path, seed: int = 0, **over) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **over))
    with torch.no_grad():  # HF's init leaves some weights (norms, biases) constant: make every one matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return str(path)


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def batch(seed: int = 3, bsz: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (bsz, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def full_tensor(param, group_size):
    """The whole tensor of a sharded parameter, gathered over the default group."""
    import torch.distributed as dist

    if not getattr(param, "tensor_model_parallel", False):
        return param.detach().clone()
    shards = [torch.empty_like(param) for _ in range(group_size)]
    dist.all_gather(shards, param.detach().contiguous())
    dim, stride = param.partition_dim, param.partition_stride
    # stride s: rank r holds chunks r, r + tp, ... of the s * tp chunks of the full dimension
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(group_size)], dim=dim)


# --------------------------------------------------------------------------- 2 ranks: sharding and generation

def _shard_case(kind, path, world_size):
    import shardwise
    from shardwise.tensor_parallel import shard_model

    ref = load(path)
    data = batch()
    ref_loss = ref(**data).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = shard_model(load(path), None)
    n_sharded = sum(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
    assert n_sharded > 0
    loss = model(**data).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(full_tensor(p, world_size), ref.get_parameter(name).detach(), rtol=0, atol=0,
                                   msg=lambda m: f"{kind} weight {name}: {m}")
        torch.testing.assert_close(_grad_full(p, world_size),
                                   ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{kind} grad {name}: {m}")
        if getattr(p, "tensor_model_parallel", False):  # DeepSpeed's per-parameter gather and re-partition
            piece = p.detach().clone()
            p.gather_params([p])
            assert torch.equal(p.detach(), ref.get_parameter(name).detach()), (kind, name)
            p._tp_partition([p])
            assert torch.equal(p.detach(), piece), (kind, name)

    # greedy generation: sharded across the ranks == one process
    prompt = batch(seed=7, bsz=2, seq=5)["input_ids"]
    ref.eval()
    want = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    engine = shardwise.init_inference(load(path), tensor_parallel={"tp_size": world_size}, dtype=torch.float32)
    got = engine.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), (kind, got, want)
    assert any(getattr(p, "tensor_model_parallel", False) for p in engine.module.parameters())

    if kind == "llama":  # the engine's first-forward check: a tensor group must be fed one batch
        import torch.distributed as dist

        from shardwise.tensor_parallel.autotp import _check_first_batch

        model = shard_model(load(path), None)
        _check_first_batch(model, None, 0)
        with pytest.raises(ValueError, match="tensor-parallel group were given different batches"):
            model(**batch(seed=dist.get_rank()))
    return kind


def _grad_full(param, world_size):
    g = param.grad
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(g, attr, getattr(param, attr))
    return full_tensor(g, world_size)




# --------------------------------------------------------------------------- 2 ranks: training through initialize

LR, CLIP, STEPS = 1e-2, 0.5, 3


def _ds_config(zero: int, tp: int | None, micro: int = 2) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": CLIP, "zero_optimization": {"stage": zero},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "steps_per_print": 10**9}
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


class _Reference:
    """The model trained in this one process with torch's AdamW and clipping: what every run must match."""

    def __init__(self, path):
        self.model = load(path)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)

    def step(self, data) -> float:
        loss = self.model(**data).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def _train_case(zero, path, ckpt_root, world_size):
    import torch.distributed as dist

    import shardwise
    from shardwise.topology import ParallelGrid

    model = load(path)
    if zero == 2:  # DeepSpeed's other spelling: tp_model_init records tp_size, initialize shards
        from shardwise.tensor_parallel.autotp import _reset_tp_model_init

        assert shardwise.tp_model_init(model, tp_size=2, dtype=torch.float32) is model
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_ds_config(zero, None))
        _reset_tp_model_init()  # the record lasts for the process, as in DeepSpeed
    else:
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_ds_config(zero, 2))
    assert engine.module.ds_autotp_parsed and engine.grid.get_tensor_model_parallel_world_size() == 2
    # the engine's data loader splits by data-parallel rank only: both tensor ranks get the same batch
    first = next(iter(engine.deepspeed_io([torch.tensor([i]) for i in range(8)])))
    seen = [torch.empty_like(first) for _ in range(world_size)]
    dist.all_gather(seen, first)
    assert torch.equal(seen[0], seen[1]), seen
    ref = _Reference(path)
    for step in range(STEPS):
        data = batch(seed=10 + step)
        loss = engine(**data).loss
        engine.backward(loss)
        engine.step()
        want = ref.step(data)
        assert abs(loss.item() - want) <= 1e-6 * abs(want), (zero, step, loss.item(), want)
    ckpt = f"{ckpt_root}/zero{zero}"
    engine.save_checkpoint(ckpt, tag="t")
    if zero == 1:
        _check_export(engine, ref, path, f"{ckpt}/hf")

    # load the tp-2 checkpoint into the unsharded model at tp 1 (2 data-parallel ranks) and continue
    rank = dist.get_rank()
    model1 = load(path)
    engine1, *_ = shardwise.initialize(model=model1, model_parameters=model1.parameters(),
                                       config=_ds_config(zero, None, micro=1), mpu=ParallelGrid.data_parallel_only())
    engine1.load_checkpoint(ckpt, tag="t")
    for step in range(STEPS, STEPS + 2):
        data = batch(seed=10 + step)
        mine = {k: v[rank:rank + 1] for k, v in data.items()}  # one sample per data-parallel rank
        loss = engine1(**mine).loss
        engine1.backward(loss)
        engine1.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        want = ref.step(data)
        assert abs(mean.item() / world_size - want) <= 1e-6 * abs(want), (zero, step, mean.item() / 2, want)
    return zero


def _train_gpt2_case(path, ckpt_root):
    """GPT-2 (fused c_attn, strided shards) trains at ZeRO 0 like one process and exports whole weights."""
    import shardwise

    model = load(path)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(0, 2))
    ref = _Reference(path)
    for step in range(2):
        data = batch(seed=20 + step)
        loss = engine(**data).loss
        engine.backward(loss)
        engine.step()
        want = ref.step(data)
        assert abs(loss.item() - want) <= 1e-6 * abs(want), (step, loss.item(), want)
    _check_export(engine, ref, path, f"{ckpt_root}/gpt2")  # c_attn's strided shards reassembled
    return "gpt2"


class _PlanModel(torch.nn.Module):
    """Projections named nothing AutoTP's rules know: sharded by the Hugging Face tp_plan on its config."""

    def __init__(self):
        import types

        super().__init__()
        self.config = types.SimpleNamespace(base_model_tp_plan={
            "blocks.*.mix.inp": "colwise", "blocks.*.mix.out": "rowwise", "head": "colwise_gather_output"})
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"mix": torch.nn.ModuleDict(
            {"inp": torch.nn.Linear(8, 16), "out": torch.nn.Linear(16, 8)})}) for _ in range(2))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b["mix"]["out"](torch.relu(b["mix"]["inp"](x)))
        return self.head(x)


def _train_plan_case():
    """A model sharded by its tp_plan trains at ZeRO 0 like one process."""
    import shardwise
    from shardwise.tensor_parallel.autotp_layers import LinearAllreduce, LinearLayer

    torch.manual_seed(0)
    model, ref = _PlanModel(), _PlanModel()
    ref.load_state_dict(model.state_dict())
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(0, 2))
    assert isinstance(model.blocks[1]["mix"]["inp"], LinearLayer) and isinstance(model.blocks[1]["mix"]["out"],
                                                                                  LinearAllreduce)
    # colwise_gather_output: split by outputs, the output gathered
    assert isinstance(model.head, LinearLayer) and model.head.gather_output and tuple(model.head.weight.shape) == (2, 8)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(30 + step)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        want = torch.nn.functional.mse_loss(ref(x), y)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item()), (step, loss.item(), want.item())
    return "plan"


def _compat_layers_case(rank, compat):
    """DeepSpeed's AutoTP layer classes of the compat package (``deepspeed.module_inject.layers``): forward and
    gradients equal the unsharded layers, the universal-checkpoint metadata each parameter carries restores
    exactly the piece the rank holds, ``gather_params`` / ``_tp_partition`` round-trip, and a split
    shardwise's checkpoints cannot describe is refused. Last case of the spawn: importing the compat package
    installs its import hook for ``deepspeed``."""
    import sys

    import pytest
    sys.path.insert(0, compat)
    from deepspeed.checkpoint.constants import (PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS,
                                                TP_REPLICATED_PARAMETER_PATTERNS)
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition
    from deepspeed.module_inject.layers import (GateUpPack_LinearLayer, LinearAllreduce, LinearLayer,
                                                SubParamLinearLayer, collect_autotp_universal_checkpoint_info,
                                                set_autotp_mode)

    set_autotp_mode(training=True)
    group = torch.distributed.new_group([0, 1])
    torch.manual_seed(0)
    col, row, qkv, gate_up = (torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.Linear(8, 12),
                              torch.nn.Linear(8, 12, bias=False))
    x = torch.randn(3, 8)

    model = torch.nn.Module()
    model.col = LinearLayer(copy.deepcopy(col), group, name="col")
    model.row = LinearAllreduce(copy.deepcopy(row), group, name="row")
    model.qkv = SubParamLinearLayer(copy.deepcopy(qkv), group, shape=(3, -1), partition_dim=0, name="qkv")
    model.gate_up = GateUpPack_LinearLayer(copy.deepcopy(gate_up), group, name="dense_h_to_4h")

    # forward and gradients: the unsharded layers' (row-parallel output all-reduced, bias added once)
    out = model.row(model.col(x))
    want = row(col(x))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(model.col.weight.grad, col.weight.grad.chunk(2, 0)[rank], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.row.weight.grad, row.weight.grad.chunk(2, 1)[rank], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.row.bias.grad, row.bias.grad, rtol=1e-6, atol=1e-7)

    # sub-parameters: each rank holds its slice of every block (Megatron's strided layout, stride = blocks)
    pieces = {"qkv": torch.cat([b.chunk(2, 0)[rank] for b in qkv.weight.detach().chunk(3, 0)]),
              "gate_up": torch.cat([b.chunk(2, 0)[rank] for b in gate_up.weight.detach().chunk(2, 0)])}
    assert torch.equal(model.qkv.weight.detach(), pieces["qkv"]) and model.qkv.weight.partition_stride == 3
    assert torch.equal(model.gate_up.weight.detach(), pieces["gate_up"]) and model.gate_up.weight.partition_stride == 2
    torch.testing.assert_close(model.qkv(x), torch.nn.functional.linear(x, pieces["qkv"], torch.cat(
        [b.chunk(2, 0)[rank] for b in qkv.bias.detach().chunk(3, 0)])), rtol=1e-6, atol=1e-7)

    # the metadata restores exactly the piece the rank holds, from the whole tensor
    for name, full in (("col", col.weight), ("row", row.weight), ("qkv", qkv.weight), ("gate_up", gate_up.weight)):
        param = getattr(model, name).weight
        got = _resolve_autotp_partition(param, {}, full.detach().flatten(), rank, 2)
        assert torch.equal(got, param.detach().flatten()), name
        piece = param.detach().clone()
        param.gather_params([param])
        assert torch.equal(param.detach(), full.detach()), name
        param._tp_partition([param])
        assert torch.equal(param.detach(), piece), name

    info = collect_autotp_universal_checkpoint_info(model)
    assert info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^row\.weight$"]
    assert r"^row\.bias$" in info[TP_REPLICATED_PARAMETER_PATTERNS]
    assert [e["patterns"] for e in info[PARAMETER_WITH_SUB_PARAMS]] == [[r"^qkv\.weight$"], [r"^qkv\.bias$"],
                                                                        [r"^gate_up\.weight$"]]

    # splits shardwise's tensor-parallel checkpoints cannot describe are refused, naming the layer
    with pytest.raises(ValueError, match="'odd': its split .5, 4. is uneven"):
        LinearLayer(torch.nn.Linear(8, 9), group, name="odd")
    with pytest.raises(ValueError, match="'gqa': sub-parameters \\[8, 4, 4\\]"):
        SubParamLinearLayer(torch.nn.Linear(8, 16), group, shape=((8, 4, 4), -1), partition_dim=0, name="gqa")

    # deepspeed.initialize with AutoTP: the engine's own layers (shardwise's), the head split by Llama's tp_plan,
    # and DeepSpeed's universal_checkpoint_info attached to the model, as DeepSpeed's engine does
    import deepspeed
    from deepspeed.checkpoint.constants import (ORIGINAL_VOCAB_SIZE, UNIVERSAL_CHECKPOINT_INFO,
                                                VOCABULARY_PARAMETER_PATTERNS)

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(tiny_config("llama"))
    deepspeed.initialize(model=llama, model_parameters=llama.parameters(), config=_ds_config(0, 2))
    assert llama.lm_head.gather_output and tuple(llama.lm_head.weight.shape) == (VOCAB // 2, 32)
    info = getattr(llama, UNIVERSAL_CHECKPOINT_INFO)
    layer = r"^model\.layers\.0\."
    assert info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == sorted(
        rf"^model\.layers\.{i}\.{m}\.weight$" for i in range(2) for m in ("self_attn\\.o_proj", "mlp\\.down_proj"))
    replicated = info[TP_REPLICATED_PARAMETER_PATTERNS]
    assert r"^model\.embed_tokens\.weight$" in replicated and layer + r"input_layernorm\.weight$" in replicated
    assert not any("_proj" in p or "lm_head" in p for p in replicated)  # every projection and the head are cut
    assert info[VOCABULARY_PARAMETER_PATTERNS] == [r"^lm_head\.weight$"] and info[ORIGINAL_VOCAB_SIZE] == VOCAB
    return "compat"


def _check_export(engine, ref, path, out):
    """save_16bit_model writes the ordinary, unsharded Hugging Face weights of the trained model."""
    import shutil

    import torch.distributed as dist

    assert engine.save_16bit_model(out)
    if dist.get_rank() == 0:  # one writer: the other rank may already be reading it
        shutil.copy(f"{path}/config.json", f"{out}/config.json")
    dist.barrier()
    exported = load(out)
    for name, p in ref.model.named_parameters():  # Adam turns float noise in tiny gradients into ~lr/1e3
        torch.testing.assert_close(exported.get_parameter(name), p.detach(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        data = batch(seed=99)
        want = ref.model(**data).loss.item()
        assert abs(exported(**data).loss.item() - want) <= 1e-6 * want


def _body(rank, world_size, paths, ckpt_root):
    def case(name):
        what, arg = name.split(":")
        if what == "shard":
            return _shard_case(arg, paths[arg], world_size)
        if arg == "gpt2":
            return _train_gpt2_case(paths["gpt2"], ckpt_root)
        if arg == "plan":
            return _train_plan_case()
        if arg == "compat":
            return _compat_layers_case(rank, COMPAT)
        return _train_case(int(arg), paths["llama"], ckpt_root, world_size)
    return run_subtests(case, CASES)


CASES = ("shard:llama", "shard:qwen3", "shard:gpt2", "train:1", "train:2", "train:gpt2", "train:plan", "train:compat")


def test_autotp_equals_one_process(tmp_path):
    """One 2-rank spawn: sharded forward/backward and init_inference greedy tokens for Llama (grouped kv
    heads), Qwen3 (q/k norms, tied embeddings) and GPT-2 (fused c_attn); Llama training at ZeRO 1 and 2
    through initialize, then the tp-2 checkpoint loaded at tp 1 and training continued; GPT-2 training; a model
    sharded by its Hugging Face tp_plan; DeepSpeed's layer classes of the compat package."""
    paths = {kind: save_tiny(kind, tmp_path / kind) for kind in ("llama", "qwen3", "gpt2")}
    results = run_distributed(_body, 2, args=(paths, str(tmp_path / "ckpt")), timeout=300)
    assert results == [["llama", "qwen3", "gpt2", 1, 2, "gpt2", "plan", "compat"]] * 2


# --------------------------------------------------------------------------- in process: no ranks needed

def test_bad_head_counts_name_the_config_values():
    from shardwise.tensor_parallel.autotp import check_head_counts

    model = transformers.LlamaForCausalLM(tiny_config("llama", num_attention_heads=4, num_key_value_heads=2))
    check_head_counts(model, 2)
    with pytest.raises(ValueError, match=r"LlamaConfig has num_key_value_heads = 2, which must be divisible by the "
                                         r"tensor-parallel size \(tensor_parallel.autotp_size / tp_size = 4\)"):
        check_head_counts(model, 4)
    model = transformers.GPT2LMHeadModel(tiny_config("gpt2", n_head=2))
    with pytest.raises(ValueError, match=r"GPT2Config has num_attention_heads = 2"):
        check_head_counts(model, 4)


def test_plan_gathered_heads_split_unless_tied_or_uneven():
    """A tp_plan's colwise_gather_output linears (Hugging Face's causal-LM heads) are split by outputs when their
    weight is their own and the outputs divide by the tensor size; a tied head stays whole."""
    from shardwise.tensor_parallel.autotp import AutoTP, gathered_columns, hf_tp_plan

    llama = transformers.LlamaForCausalLM(tiny_config("llama"))
    plan = hf_tp_plan(llama)
    assert plan["lm_head"] == "colwise_gather_output"
    taken = {f"{b.name}.{c}" for b in AutoTP.tp_parser(llama) for c in b.column + b.row}
    assert gathered_columns(llama, plan, 2, taken) == ["lm_head"]
    assert gathered_columns(llama, plan, 5, taken) == []  # 96 outputs over 5 ranks: whole
    assert gathered_columns(llama, plan, 1, taken) == []
    assert gathered_columns(llama, {"lm_head": "colwise"}, 2, taken) == []  # not a gathered style
    qwen3 = transformers.Qwen3ForCausalLM(tiny_config("qwen3"))  # tie_word_embeddings: the head is the embedding
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight
    assert gathered_columns(qwen3, hf_tp_plan(qwen3), 2) == []


def test_parser_roles_and_refusals():
    from shardwise.tensor_parallel.autotp import AutoTP

    blocks = AutoTP.tp_parser(transformers.LlamaForCausalLM(tiny_config("llama")))
    assert [(b.name, b.column, b.row) for b in blocks] == [
        (f"model.layers.{i}.{part}", cols, rows) for i in range(2) for part, cols, rows in (
            ("self_attn", ["q_proj", "k_proj", "v_proj"], ["o_proj"]),
            ("mlp", ["gate_proj", "up_proj"], ["down_proj"]))]
    gpt2 = AutoTP.tp_parser(transformers.GPT2LMHeadModel(tiny_config("gpt2")))
    assert [(b.column, b.row) for b in gpt2[:2]] == [(["c_attn"], ["c_proj"]), (["c_fc"], ["c_proj"])]
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0))
    with pytest.raises(NotImplementedError, match=r"'model.layers.0.self_attn.qkv_proj' \(Phi3Attention\) is a fused "
                                                  r"projection"):
        AutoTP.tp_parser(phi3)
    with pytest.raises(ValueError, match="found no attention/MLP projections to shard in Sequential"):
        AutoTP.tp_parser(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize("kind", ["linear", "conv1d", "fused_conv1d"])
def test_layer_slices_recompose_the_full_layer(kind):
    """Column slices concatenate, row partial products sum, to the unsharded layer (the slicing of
    the distributed layers, without the all-reduce)."""
    from transformers.pytorch_utils import Conv1D

    from shardwise.tensor_parallel.autotp_layers import LinearAllreduce, LinearLayer

    torch.manual_seed(0)
    make = (lambda i, o: torch.nn.Linear(i, o)) if kind == "linear" else (lambda i, o: Conv1D(o, i))
    parts = 3 if kind == "fused_conv1d" else 1
    x = torch.randn(3, 8)
    col_full, row_full = make(8, 12), make(12, 8)
    h_full = col_full(x)
    cols = [LinearLayer(_clone(col_full), None, fused_parts=parts, tp_size=2, tp_rank=r) for r in range(2)]
    hs = [c(x) for c in cols]
    blocks = [h.chunk(parts, dim=-1) for h in hs]  # rank r: its slice of each fused block
    torch.testing.assert_close(torch.cat([blocks[r][p] for p in range(parts) for r in range(2)], -1), h_full)
    assert cols[0].weight.tensor_model_parallel and cols[0].weight.partition_stride == parts
    assert cols[0].weight.partition_dim == (1 if kind != "linear" else 0)
    rows = [LinearAllreduce(_clone(row_full), None, tp_size=2, tp_rank=r) for r in range(2)]
    partial = [rows[r](h_full.chunk(2, dim=-1)[r]) - rows[r].bias for r in range(2)]
    torch.testing.assert_close(partial[0] + partial[1] + row_full.bias, row_full(h_full))
    assert not getattr(rows[0].bias, "tensor_model_parallel", False)


def _clone(module):
    import copy

    return copy.deepcopy(module)


def test_tensor_parallel_config_block():
    from shardwise.config import ConfigError, load_config

    cfg = load_config({"tensor_parallel": {"autotp_size": 2, "tensor_parallel": {"tp_size": 2}, "kernel_inject": False,
                                           "keep_module_on_host": True, "preset_model": "llama"}})
    cfg.check_supported()
    assert cfg.tensor_parallel.autotp_size == 2 and cfg.tensor_parallel.tp.tp_size == 2
    for block, problem in [({"autotp_size": 2, "tp_overlap_comm": True}, "not implemented yet: tensor_parallel.tp_overlap_comm"),
                           ({"autotp_size": 2, "vocab_parallel_lm_head": True}, "tensor_parallel.vocab_parallel_lm_head"),
                           ({"autotp_size": 2, "replace_with_kernel_inject": True}, "replace_with_kernel_inject"),
                           ({"autotp_size": 2, "preset_model": "bloom"}, "preset_model (= 'bloom')"),
                           ({"autotp_size": 2, "partition_config": {"layer_specs": []}}, "partition_config")]:
        with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            load_config({"tensor_parallel": block}).check_supported()
    with pytest.raises(ConfigError, match=r"tp.tp_size \(4\) does not match tensor_parallel.autotp_size \(2\)"):
        load_config({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}})
    with pytest.raises(ConfigError, match="tensor_parallel.dtype is bf16 but the model trains in fp32"):
        load_config({"tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}})
    with pytest.raises(ConfigError, match="did you mean 'autotp_size'"):
        load_config({"tensor_parallel": {"autotp": 2}})


def test_tp_model_init_records_and_merges():
    import shardwise
    from shardwise.config import load_config
    from shardwise.tensor_parallel import autotp

    model = torch.nn.Linear(2, 2)
    try:
        assert shardwise.tp_model_init(model, tp_size=2, dtype=torch.float32) is model
        assert autotp.merge_tp_model_init(load_config({})).tensor_parallel.autotp_size == 2
        with pytest.raises(ValueError, match=r"Conflicting tensor_parallel.autotp_size in config \(4\) and tp_model_init"):
            autotp.merge_tp_model_init(load_config({"tensor_parallel": {"autotp_size": 4}}))
        with pytest.raises(ValueError, match="Conflicting dtype: the config trains in bf16"):
            autotp.merge_tp_model_init(load_config({"bf16": {"enabled": True}}))
        with pytest.raises(ValueError, match="Conflicting tp_model_init arguments"):
            shardwise.tp_model_init(model, tp_size=4, dtype=torch.float32)
    finally:
        autotp._reset_tp_model_init()
    with pytest.raises(ValueError, match="tp_group=.... is not supported"):
        shardwise.tp_model_init(model, 2, torch.float32, tp_group=object())


def test_init_inference_config_errors():
    from shardwise.inference import inference_config

    assert inference_config(tensor_parallel={"tp_size": 2}, dtype=torch.float32)["tp_size"] == 2
    assert inference_config(mp_size=2)["dtype"] == torch.float16  # DeepSpeed's default dtype
    assert inference_config({"tp": {"tp_size": 2}}, max_tokens=64, replace_with_kernel_inject=False)["tp_size"] == 2
    for kwargs, problem in [({"replace_with_kernel_inject": True}, "kernel injection .* is not implemented"),
                            ({"tensor_parallel": {"tp_size": 2}, "mp_size": 4}, r"mp_size \(4\) and tensor_parallel"),
                            ({"tensor_paralel": {"tp_size": 2}}, "did you mean 'tensor_parallel'"),
                            ({"dtype": torch.int8}, "int8 needs DeepSpeed's quantised kernels"),
                            ({"enable_cuda_graph": True}, "CUDA graphs"),
                            ({"tensor_parallel": {"size": 2}}, r"unknown key\(s\) \['size'\] in tensor_parallel")]:
        with pytest.raises(ValueError, match=problem):
            inference_config(**kwargs)
