"""``shardwise plan`` against the engine, and its command line.

The plan lays out W ranks in one process over torch's fake backend. At world 8 (8 gloo processes, a tiny
GPT in every layout, a tiny MoE under AutoEP and a tiny Hugging Face Llama under AutoTP, in one spawn) each
rank's model-state bytes equal the engine's ``memory_breakdown()`` and its bytes per step equal what the comms
logger counts in a training step (the second: the first has one-off checks). The other tests run in this
process: the JSON, the errors, the memory limit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from distributed import run_distributed, run_subtests


@pytest.fixture(autouse=True)
def _no_process_group_in_this_process():
    """A plan needs the process to itself (it makes the fake backend the default group); earlier tests that
    ran an engine in the pytest process (a world of one) may have left theirs."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

HERE = os.path.dirname(__file__)
TINY_LLAMA = os.path.join(HERE, "fixtures", "plan", "tiny_llama.json")
GPT = "gpt:vocab_size=32,seq_len=8,hidden=16,n_layers=2,n_heads=2"
CASES = [  # (name, ZeRO stage, tensor, pipe, expert)
    ("dp8 ZeRO-1", 1, 1, 1, 1), ("dp8 ZeRO-2", 2, 1, 1, 1), ("dp8 ZeRO-3", 3, 1, 1, 1),
    ("tp2 x dp4 ZeRO-3", 3, 2, 1, 1), ("pp2 x tp2 x dp2 ZeRO-1", 1, 2, 2, 1), ("MoE ep2 x dp8 ZeRO-2", 2, 1, 1, 2),
    ("HF Llama AutoTP tp2 x dp4 ZeRO-1", 1, 2, 1, 1),  # its head split by the tp_plan, its logits all-gathered
]
TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "tie_word_embeddings": False}
STATES = {"params": "params_bytes", "grads": "grads_bytes", "master_params": "master_bytes",
          "optimizer_states": "optimizer_bytes"}


def _config(stage: int, tp: int, ep: int = 1) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def _moe_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_MOE)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def _engine_case(case, rank, world):
    import shardwise
    from shardwise import comm
    from shardwise.models.gpt import GPT as Model, gpt_pipeline_module
    from shardwise.planning.model import parse_model_arg
    from shardwise.parallel_dims import ParallelDims
    from shardwise.topology import ParallelGrid, ProcessTopology

    _, stage, tp, pp, ep = case
    cfg = parse_model_arg(GPT)[1]
    ds = _config(stage, 1, ep) | {"comms_logger": {"enabled": True}}
    torch.manual_seed(0)
    topo = ProcessTopology.from_dims(ParallelDims(data=world // (tp * pp), pipe=pp, tensor=tp))
    hf = case[0].startswith("HF Llama")
    if ep > 1:  # a Hugging Face MoE model, AutoEP's blocks
        engine = shardwise.initialize(model=_moe_model(), config=ds)[0]
    elif hf:  # AutoTP of a Hugging Face model (tensor_parallel.autotp_size)
        from transformers import AutoModelForCausalLM, LlamaConfig

        llama = AutoModelForCausalLM.from_config(LlamaConfig.from_json_file(TINY_LLAMA))
        engine = shardwise.initialize(model=llama, config=_config(stage, tp) | {"comms_logger": {"enabled": True}})[0]
    elif pp > 1:
        engine = shardwise.initialize(model=gpt_pipeline_module(cfg, topology=topo, partition_method="uniform"),
                                      config=ds)[0]
    else:
        grid = ParallelGrid(topo)
        with grid.active():
            model = Model(cfg)
        engine = shardwise.initialize(model=model, mpu=grid, config=ds)[0]
    g = torch.Generator().manual_seed(rank // tp if hf else rank)  # (AutoTP: one batch per tensor group)

    def batches():
        while True:
            t = torch.randint(0, 256 if hf else cfg.vocab_size, (2, 8 if hf else cfg.seq_len), generator=g)
            yield t, t

    data = batches()
    for step in range(2):
        comm.reset_comms_log()  # the second step is the steady one (the first checks ZeRO-3's gather order)
        if pp > 1:
            engine.train_batch(data_iter=data)
        else:
            for _ in range(2):
                x, y = next(data)
                engine.backward(engine(input_ids=x, labels=y).loss if ep > 1 or hf else engine(x, y))
                engine.step()
    sent: dict = {}
    for name, sizes in comm.comms_summary().items():
        sent[name] = sent.get(name, 0) + sum(size * s["count"] for size, s in sizes.items())
    comm.configure(comms_logger={"enabled": False})
    return {"states": {k: getattr(engine.memory_breakdown(), k) for k in STATES}, "sent": sent}


def _engine_body(rank, world):
    return run_subtests(_engine_case, CASES, rank, world)


def test_plan_equals_engine_memory_and_comms_at_world_8(tmp_path):
    from shardwise.planning import make_plan

    measured = run_distributed(_engine_body, 8, timeout=900)
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps(TINY_MOE))
    for i, (name, stage, tp, pp, ep) in enumerate(CASES):
        hf = name.startswith("HF Llama")
        plan = make_plan(world=8, gpus_per_node=4, model=str(moe) if ep > 1 else TINY_LLAMA if hf else GPT,
                         config=_config(stage, tp, ep), pipe=pp, partition_method="uniform",
                         seq_len=8 if ep > 1 or hf else None)
        assert [r.rank for r in plan.ranks] == list(range(8))
        for r in plan.ranks:
            engine = measured[r.rank][i]
            planned = {k: getattr(r, attr) for k, attr in STATES.items()}
            assert planned == engine["states"], f"{name}, rank {r.rank}"
            # not compared: the pipeline's point-to-point sends (the comms logger does not see them) and
            # AutoEP's token exchange (its sizes follow the routing of each batch)
            ops = {op: v for op, v in r.comm_ops.items() if op not in ("send_recv", "all_to_all")}
            if ep > 1:
                engine["sent"] = {op: v for op, v in engine["sent"].items() if "all_to_all" not in op}
            assert ops == engine["sent"], f"{name}, rank {r.rank}"
            assert sum(r.comm_bytes.values()) == sum(r.comm_ops.values())
        if pp > 1:
            assert plan.ranks[0].comm_bytes["pipe"] > 0 and plan.pipeline["layers_per_stage"] == [1, 1]


# -- single process ------------------------------------------------------------------------------------
def _write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_json_and_table(tmp_path, capsys):
    from shardwise.cli import main
    from shardwise.models.gpt import GPT as Model
    from shardwise.planning.model import parse_model_arg

    out = tmp_path / "plan.json"
    rc = main(["plan", "--world", "32", "--gpus_per_node", "8", "--model", GPT, "--config",
               _write(tmp_path, _config(2, 2)), "--pipe", "2", "--partition_method", "uniform", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "plan: 32 ranks (4 nodes x 8), data 8 x pipe 2 x tensor 2, ZeRO stage 2, bf16" in text
    assert "pipeline: 2 stages" in text and "checkpoint:" in text
    d = json.loads(out.read_text())
    for key in ("parameters", "model_states_bytes_per_rank", "activation_bytes_per_rank",
                "comm_bytes_per_step_per_rank", "seconds"):
        assert key in d, key
    assert set(d["comm_bytes_per_step_per_rank"]) == {"data", "tensor", "pipe", "sequence", "expert"}
    assert d["parameters"] == sum(p.numel() for p in Model(parse_model_arg(GPT)[1]).parameters())
    assert d["model_states_bytes_per_rank"] == max(r["model_states_bytes"] for r in d["ranks"])
    assert len(d["ranks"]) == 32 and d["seconds"] > 0
    assert d["pipeline"]["bubble_fraction"] == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1), m = 2
    # ranks of one pipeline stage hold the same pieces; the two stages differ
    stage = {r["rank"]: r["coord"]["pipe"] for r in d["ranks"]}
    assert {r["parameters"] for r in d["ranks"] if stage[r["rank"]] == 0} != \
        {r["parameters"] for r in d["ranks"] if stage[r["rank"]] == 1}


def test_hf_model_autotp_shards_the_projections(tmp_path):
    from shardwise.planning import make_plan

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(open(TINY_LLAMA).read())
    one = make_plan(world=4, gpus_per_node=4, model=str(folder), config=_config(0, 1))
    two = make_plan(world=4, gpus_per_node=4, model=str(folder), config=_config(0, 2))
    # hidden 64, intermediate 128, 4 heads of 16, 2 kv heads; 2 layers; the embedding replicated, the (untied)
    # head split by outputs as Llama's tp_plan says (colwise_gather_output)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    whole = 2 * per_layer + 2 * 256 * 64 + 64
    assert one.parameters == two.parameters == whole
    assert one.ranks[0].parameters == whole
    sharded = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + 256 * 64
    assert two.ranks[0].parameters == whole - sharded // 2
    assert two.ranks[0].comm_bytes["tensor"] > 0 and one.ranks[0].comm_bytes["tensor"] == 0


def test_plan_at_scale_samples_ranks_and_creates_every_group(tmp_path):
    from shardwise.planning import make_plan

    plan = make_plan(world=8192, gpus_per_node=8, model=GPT, config=_config(3, 2), ranks=[0, 5, 8191])
    assert [r.rank for r in plan.ranks] == [0, 5, 8191]
    # a group of each rank alone for the size-1 pipe axis, the data and model axes' groups: what every rank of
    # the engine creates. The absent sequence axis's groups (each rank alone) and the model-parallel groups (a
    # data coordinate's pipe x tensor ranks: the tensor axis's) have the same ranks, so they are the same groups
    assert plan.group_count == 8192 + 2 + 4096


@pytest.mark.parametrize("cfg,kwargs,message", [
    ({"tensor_parallel": {"autotp_size": 3}}, {}, "tensor_parallel.autotp_size 3 does not divide the world size 8"),
    ({}, {"pipe": 8}, "layers cannot fill 8 pipeline stages"),
    ({}, {"pipe": 3}, "world size 8 is not divisible by pipeline (3) x model (1) parallel sizes"),
    ({"tensor_parallel": {"autotp_size": 4}}, {"model": TINY_LLAMA},
     "AutoTP cannot shard LlamaForCausalLM over 4 tensor-parallel ranks: its LlamaConfig has num_key_value_heads = 2"),
])
def test_layouts_that_cannot_run_get_the_engines_error(tmp_path, cfg, kwargs, message):
    from shardwise.planning import PlanError, make_plan

    config = _config(1, 1) | cfg
    model = kwargs.get("model", GPT)
    with pytest.raises(ValueError) as err:
        make_plan(world=8, gpus_per_node=8, model=model, config=config, pipe=kwargs.get("pipe", 1))
    assert message in str(err.value)
    assert isinstance(err.value, (PlanError, ValueError))


def test_experts_not_divisible_is_autoeps_error(tmp_path):
    from shardwise.planning import make_plan

    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 32,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64, "num_experts": 3, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": []}))
    config = _config(1, 1) | {"expert_parallel": {"enabled": True, "autoep_size": 2}}
    with pytest.raises(ValueError, match=r"expert_parallel.autoep_size=2: the 3 experts of .* are not divisible by "
                                         r"it \(divisors: \[1, 3\]\)"):
        make_plan(world=8, gpus_per_node=8, model=str(folder), config=config)


def test_memory_over_the_limit_names_the_rank(tmp_path, capsys):
    from shardwise.cli import main

    rc = main(["plan", "--world", "8", "--gpus_per_node", "8", "--model", GPT, "--config",
               _write(tmp_path, _config(1, 1)), "--pipe", "2", "--gpu_memory", "40KiB"])
    out = capsys.readouterr()
    assert rc == 1
    assert "shardwise plan: error: rank 0 needs" in out.err and "over --gpu_memory" in out.err
    assert " 0 !" in out.out  # the table marks it


def test_cli_error_is_one_line(tmp_path, capsys):
    from shardwise.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--world", "8", "--gpus_per_node", "8", "--model", "gpt:hidden=x", "--config",
              _write(tmp_path, _config(1, 1))])
    assert exc.value.code == 2
    assert "shardwise plan: error: --model gpt:hidden=x: 'hidden=x' is not KEY=VALUE with a number" in capsys.readouterr().err


def test_model_parallel_groups_are_every_rank_of_a_data_coordinate():
    """The grid's model-parallel groups (built per data/sequence coordinate from the topology, not by scanning
    the world) hold exactly the ranks a scan finds, in the same order of creation."""
    import torch.distributed as dist

    from shardwise.parallel_dims import ParallelDims
    from shardwise.planning import fake_world
    from shardwise.topology import ParallelGrid, ProcessTopology

    dims = ParallelDims(data=3, pipe=2, tensor=2, sequence=2)
    topo = ProcessTopology.from_dims(dims)
    made = []
    with fake_world(dims.world_size):
        real = dist.new_group
        dist.new_group = lambda ranks=None, **kw: (made.append(list(ranks)), real(ranks, **kw))[1]
        try:
            grid = ParallelGrid(topo)
        finally:
            dist.new_group = real
        assert sorted(dist.get_process_group_ranks(grid.get_model_parallel_group())) == [0, 1, 12, 13]
    scan = [[r for r in range(topo.world_size) if topo.get_coord(r).data == d and topo.get_coord(r).sequence == s]
            for d in range(3) for s in range(2)]
    assert all(group in made for group in scan)
    assert [g for g in made if g in scan] == scan  # created in the same order on every rank
    assert topo.filter_match(data=1, sequence=0) == scan[2]
    with pytest.raises(ValueError, match="no axis 'expert'"):
        topo.filter_match(expert=0)
