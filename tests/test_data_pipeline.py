"""DeepSpeed's data-efficiency pieces in shardwise.data: curriculum schedules, the indexed dataset, the
offline data analyzer and random-LTD, checked against DeepSpeed 0.19.8's behaviour.

The expected values below were produced by running DeepSpeed 0.19.8's own modules (from its sdist:
``runtime/data_pipeline/curriculum_scheduler.py``, ``data_routing/scheduler.py``,
``data_sampling/data_analyzer.py`` and ``indexed_dataset.py``) on the same inputs; the sha256 sums are
of the files DeepSpeed writes, so the bytes shardwise writes must be the same.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data.analyzer import DatasetAnalyzer
from shardwise.data.curriculum import CurriculumSchedule
from shardwise.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, smallest_int_dtype
from shardwise.data.random_ltd import (TokenDropLayer, TokenDropSchedule, attach_schedule, strip_token_drop_keys,
                                       wrap_layers)

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- curriculum schedules
# DeepSpeed's CurriculumScheduler(config).update_difficulty(step) for step = 0..59
_SCHEDULES = {
    "linear": ({"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 37, "difficulty_step": 8}},
               [8, 32, 56, 88, 112, 144, 168, 200, 224, 248, 280, 304, 336, 360, 392, 416, 440, 472, 496, 528, 552,
                584, 608, 632, 664, 688, 720, 744, 776, 800, 824, 856, 880, 912, 936, 968, 992] + [1024] * 23),
    # min_difficulty not a multiple of difficulty_step: floored to 0, raised to the first multiple (16)
    "linear_odd": ({"min_difficulty": 8, "max_difficulty": 100, "schedule_type": "fixed_linear",
                    "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 16}},
                   [16] * 6 + [32] * 3 + [48] * 4 + [64] * 3 + [80] * 4 + [96] * 3 + [100] * 37),
    "root": ({"min_difficulty": 64, "max_difficulty": 2048, "schedule_type": "fixed_root",
              "schedule_config": {"total_curriculum_step": 50, "difficulty_step": 8, "root_degree": 2}},
             [64, 344, 456, 544, 624, 688, 744, 800, 856, 904, 944, 992, 1032, 1072, 1112, 1144, 1184, 1216, 1248,
              1280, 1312, 1344, 1376, 1408, 1432, 1464, 1488, 1520, 1544, 1568, 1600, 1624, 1648, 1672, 1696, 1720,
              1744, 1768, 1792, 1816, 1832, 1856, 1880, 1896, 1920, 1944, 1960, 1984, 2000, 2024] + [2048] * 10),
    "root3": ({"min_difficulty": 3, "max_difficulty": 77, "schedule_type": "fixed_root",
               "schedule_config": {"total_curriculum_step": 13, "difficulty_step": 4, "root_degree": 3}},
              [4, 32, 40, 48, 52, 56, 60, 60, 64, 68, 68, 72, 72, 76, 76] + [77] * 45),
    "discrete": ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
                  "schedule_config": {"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]}},
                 [1, 1, 1, 2, 2, 3, 3, 4, 4] + [5] * 51),
}


@pytest.mark.parametrize("name", sorted(_SCHEDULES))
def test_curriculum_schedule_gives_deepspeeds_difficulty_per_step(name):
    config, expected = _SCHEDULES[name]
    schedule = CurriculumSchedule(config)
    assert [schedule.update_difficulty(step) for step in range(60)] == expected
    assert schedule.get_current_difficulty() == expected[-1]


def test_curriculum_engine_test_ground_truth():
    # DeepSpeed's own unit test (TestLegacyCurriculumScheduler): step n+1 of training -> seqlen
    cfg = {"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
           "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}
    s = CurriculumSchedule(cfg)
    assert [s.update_difficulty(n) for n in range(1, 11)] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]


def test_curriculum_custom_schedule_and_stops_at_max():
    s = CurriculumSchedule({"min_difficulty": 1, "max_difficulty": 50, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        s.update_difficulty(1)
    s.set_custom_get_difficulty(lambda step: 10 * step)
    assert [s.update_difficulty(k) for k in (1, 3, 6, 2)] == [10, 30, 60, 60]  # frozen once >= max


@pytest.mark.parametrize("config, message", [
    ({"max_difficulty": 5, "schedule_type": "fixed_linear"}, "needs 'min_difficulty'"),
    ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "cosine"}, "schedule_type: 'cosine'"),
    ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8}}, "needs 'root_degree'"),
    ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
      "schedule_config": {"difficulty": [1, 2], "max_step": [2, 4]}}, "one more entry"),
])
def test_curriculum_bad_config_is_named(config, message):
    with pytest.raises(ValueError, match=message):
        CurriculumSchedule(config, where="data_efficiency.x")


# --------------------------------------------------------------------------- indexed dataset
def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_indexed_dataset_bytes_match_megatron_format_and_read_back(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "tok.bin"), dtype=np.uint16)
    w.add_item(torch.tensor([1, 2, 3]))
    w.add_item(torch.tensor([4]))
    w.end_document()
    w.add_item(torch.tensor([5, 6]))
    w.end_document()
    w.finalize(str(tmp_path / "tok.idx"))
    # DeepSpeed's MMapIndexedDatasetBuilder(..., dtype=np.uint16) on the same calls
    assert _sha(tmp_path / "tok.bin") == "b1cd5bf03b9488553472b7264c8d53326d8d6b2aa42ab53e2d0f27387db492d5"
    assert _sha(tmp_path / "tok.idx") == "24d67ed3b9d184546ce233a738161c545afaf3094c3197b13e273710064a5cc0"
    ds = IndexedDataset(str(tmp_path / "tok"), skip_warmup=True)
    assert len(ds) == 3 and ds.dtype == np.uint16
    assert [list(ds[i]) for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    assert [list(x) for x in ds[1:3]] == [[4], [5, 6]]
    assert list(ds.get(0, offset=1, length=2)) == [2, 3] and list(ds.get(0, offset=1)) == [2, 3]
    assert list(ds.sizes) == [3, 1, 2] and list(ds.doc_idx) == [0, 2, 3]
    # merging appends items and shifts document boundaries
    m = IndexedDatasetWriter(str(tmp_path / "both.bin"), dtype=np.uint16)
    m.merge_file_(str(tmp_path / "tok"))
    m.merge_file_(str(tmp_path / "tok"))
    m.finalize(str(tmp_path / "both.idx"))
    both = IndexedDataset(str(tmp_path / "both"), skip_warmup=True)
    assert [list(both[i]) for i in range(6)] == [[1, 2, 3], [4], [5, 6]] * 2 and list(both.doc_idx) == [0, 2, 3, 5, 6]
    with pytest.raises(ValueError, match="holds uint16"):
        IndexedDatasetWriter(str(tmp_path / "x.bin"), dtype=np.int32).merge_file_(str(tmp_path / "tok"))


def test_indexed_dataset_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        IndexedDataset(str(tmp_path / "missing"))
    (tmp_path / "bad.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="bad.idx: not a memory-mapped"):
        IndexedDataset(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="float32 is not one of"):
        IndexedDatasetWriter(str(tmp_path / "f.bin"), dtype=np.float32)
    assert smallest_int_dtype(0, 255) is np.uint8 and smallest_int_dtype(0, 256) is np.uint16
    assert smallest_int_dtype(-1, 127) is np.int8 and smallest_int_dtype(-1, 40000) is np.int32


# --------------------------------------------------------------------------- data analyzer
_LENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
_LENS2 = [(i * 37) % 211 + 250 for i in range(300)]

# sha256 of the files DeepSpeed 0.19.8's DataAnalyzer writes for the two runs below
_DS_FILES = {
    "seqlen/seqlen_sample_to_metric.bin": "e587086b2eebc71cf6630d8e201164702793b2c0a637fde8de5a9ca735b682f6",
    "seqlen/seqlen_sample_to_metric.idx": "ec8a48065cb427ade13ef771358ac8c23eba237633f9d908dfbd774265bc1174",
    "seqlen/seqlen_index_to_sample.bin": "0379710b1c1024c03201680d8d16dbb2135858de436eb705314f7d46bc812f2c",
    "seqlen/seqlen_index_to_sample.idx": "0392d1e395ef5a124af2f5725574ad6129982f014098bd7c8ff8353fdc583857",
    "seqlen/seqlen_index_to_metric.bin": "47e4ee7f211f73265dd17658f6e21c1318bd6c81f37598e20a2756299542efcf",
    "seqlen/seqlen_index_to_metric.idx": "32269ec3d2b432176cfb810fb8f8ea6b27443ccb64bfe9e4a2984ac2cce5a015",
    "seqlen/seqlen_index_to_sample_percentile_merged.bin":
        "0379710b1c1024c03201680d8d16dbb2135858de436eb705314f7d46bc812f2c",
    "seqlen/seqlen_index_to_sample_percentile_merged.idx":
        "cba9bc9c489b42b755153fd0f88102a8f4275e17bf7ce7d6bd7c79db4b07b47a",
    "total/total_metric_value.bin": "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb",
    "total/total_metric_value.idx": "92fa57537871fcbe0cfa53dce80a334d987443073c10e8afe2978ff5ae4b0c24",
}
_DS_FILES2 = {
    "len/len_sample_to_metric.bin": "a34b6ba4a745b4b82344138edd998bf6555baf413b889a65601721b21992711c",
    "len/len_sample_to_metric.idx": "8f1e1101b3fd7b9f7567b8d45f551d4eb87697735bd4a25be26b8fe570e5a527",
    "len/len_index_to_sample.bin": "146b1f31b40af7228c50c077d6aa9485342f18c95eed28cf912eab5959b52589",
    "len/len_index_to_sample.idx": "e819b6cb9ddeb2f7ca38d0e0b352964f63202541cc2401aab070aed3b371d645",
    "len/len_index_to_metric.bin": "5e397012f9371aecbb70157164b7ed5d0a37de980f94e8c72b3ef972b82fe941",
    "len/len_index_to_metric.idx": "67acc340c84e2af94a7b5c3f3da194904f5e43d66fa5264b29b498818e8153ba",
    "len/len_index_to_sample_percentile_merged.bin":
        "146b1f31b40af7228c50c077d6aa9485342f18c95eed28cf912eab5959b52589",
    "len/len_index_to_sample_percentile_merged.idx":
        "6becf188df9987b3677ceba1c562eecc93a45b51c770e1600e53ddfd0bb37428",
}


def _analyze(out, analyzer=DatasetAnalyzer):
    ds = [torch.tensor([n, i]) for i, n in enumerate(_LENS)]
    analyzer(ds, num_workers=1, worker_id=0, num_threads=2, num_threads_reduce=2, batch_size=3,
             metric_names=["seqlen", "total"],
             metric_functions=[lambda b: b[:, 0].clone(), lambda b: b[:, 0].sum().reshape(1)],
             metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
             metric_dtypes=[torch.int64, torch.int64], save_path=str(out)).run_map_reduce()


def test_data_analyzer_writes_deepspeeds_files(tmp_path):
    _analyze(tmp_path)
    assert {name: _sha(tmp_path / name) for name in _DS_FILES} == _DS_FILES
    # what DeepSpeed's data sampler reads: index_to_metric ascending, index_to_sample the samples of each value
    to_metric = IndexedDataset(str(tmp_path / "seqlen/seqlen_index_to_metric"), skip_warmup=True)
    to_sample = IndexedDataset(str(tmp_path / "seqlen/seqlen_index_to_sample"), skip_warmup=True)
    values = [int(to_metric[j][0]) for j in range(len(to_metric))]
    assert values == sorted(set(_LENS)) and to_metric.dtype == np.uint8 and to_sample.dtype == np.uint8
    for j, v in enumerate(values):
        assert list(to_sample[j]) == [i for i, n in enumerate(_LENS) if n == v]
    s2m = IndexedDataset(str(tmp_path / "seqlen/seqlen_sample_to_metric"), skip_warmup=True)
    assert [int(s2m[i][0]) for i in range(len(s2m))] == _LENS
    total = IndexedDataset(str(tmp_path / "total/total_metric_value"), skip_warmup=True)
    assert list(total[0]) == [sum(_LENS)]


def test_data_analyzer_percentile_merge_and_wider_dtypes(tmp_path):
    ds = [torch.tensor([n]) for n in _LENS2]
    DatasetAnalyzer(ds, batch_size=16, metric_names=["len"], metric_functions=[lambda b: b[:, 0].clone()],
                    metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                    save_path=str(tmp_path)).run_map_reduce()
    assert {name: _sha(tmp_path / name) for name in _DS_FILES2} == _DS_FILES2
    merged = IndexedDataset(str(tmp_path / "len/len_index_to_sample_percentile_merged"), skip_warmup=True)
    assert len(merged) == 106  # 211 distinct values in runs of 211 // 100 = 2
    assert sorted(np.concatenate(merged[0:len(merged)]).tolist()) == list(range(300))
    assert IndexedDataset(str(tmp_path / "len/len_index_to_metric"), skip_warmup=True).dtype == np.uint16


def test_data_analyzer_bad_input_is_named(tmp_path):
    ds = [torch.tensor([1])] * 4
    with pytest.raises(ValueError, match="one entry per metric"):
        DatasetAnalyzer(ds, metric_names=["a"], metric_functions=[], metric_types=[], metric_dtypes=[])
    with pytest.raises(ValueError, match="type 'per_batch'"):
        DatasetAnalyzer(ds, metric_names=["a"], metric_functions=[len], metric_types=["per_batch"],
                        metric_dtypes=[torch.int64])
    bad = DatasetAnalyzer(ds, metric_names=["a"], metric_functions=[lambda b: b[:, 0].float()],
                          metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                          save_path=str(tmp_path))
    with pytest.raises(TypeError, match="returned dtype torch.float32"):
        bad.run_map()


# --------------------------------------------------------------------------- random-LTD
def _ltd_config(**over):
    cfg = {"total_layer_num": 12, "random_ltd_layer_num": 10, "global_batch_size": 4,
           "layer_token_lr_schedule": {"enabled": False},
           "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 100, "seq_per_step": 16}}}
    cfg.update(over)
    return cfg


def test_random_ltd_schedule_matches_deepspeed():
    s = TokenDropSchedule(_ltd_config())
    seen = []
    for step in range(0, 120, 7):
        s.update_seq(step)
        seen.append(s.get_current_seq())
    assert seen == [128, 256, 384, 528, 656, 800, 928, 1056, 1200, 1328, 1472, 1600, 1728, 1872, 2000, 2048, 2048,
                    2048]
    assert s.state["consumed_layer_tokens"] == 1178112
    restored = TokenDropSchedule(_ltd_config())
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, h, attention_mask=None):
        # token mixing through the mask, so the cut mask matters: out = lin(h) + mask-weighted mean of h
        w = attention_mask[:, 0].float() if attention_mask is not None else torch.ones(h.shape[0], h.shape[1],
                                                                                      h.shape[1])
        return self.lin(h) + torch.bmm(w, h) / h.shape[1]


class _Net(torch.nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, h, mask):
        for layer in self.layers:
            h = layer(h, attention_mask=mask)
        return h


def test_random_ltd_layer_runs_the_layer_on_the_kept_tokens_only():
    torch.manual_seed(0)
    d, seq, batch = 4, 10, 3
    net = _Net(d, 2)
    ref_blocks = [copy_block(b) for b in net.layers]
    wrap_layers(net, _Block)
    assert all(isinstance(m, TokenDropLayer) for m in net.layers)
    sched = TokenDropSchedule(_ltd_config(total_layer_num=2, random_ltd_layer_num=2, random_ltd_schedule={
        "min_value": 6, "max_value": seq, "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 10, "seq_per_step": 2}}))
    config = {"random_ltd_layer_id": [0, 1], "random_ltd_layer_num": 2, "model_mask_name": "attention_mask",
              "model_type": "decoder", "hidden_state_order": "batch_seq_dim", "micro_batch_size": batch}
    assert attach_schedule(net, config, sched) == 2
    h = torch.randn(batch, seq, d, requires_grad=True)
    mask = torch.tril(torch.ones(seq, seq)).expand(batch, 1, seq, seq)
    out = net(h, mask)
    idx = sched.state["sample_idx"]  # [layers, batch, kept], sorted
    assert idx.shape == (2, batch, 6) and torch.equal(idx, idx.sort(-1).values)
    # by hand: each layer replaces only its kept tokens by the block applied to them (mask cut to 6x6)
    expect = h
    for layer, block in enumerate(ref_blocks):
        nxt = expect.clone()
        for b in range(batch):
            keep = idx[layer, b].long()
            nxt[b, keep] = block(expect[b:b + 1, keep], attention_mask=mask[b:b + 1, :, :6, :6])[0]
        expect = nxt
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # gradients: skipped tokens pass through (identity), kept ones through the block
    g = torch.randn_like(out)
    (gh,) = torch.autograd.grad(out, h, g)
    (ge,) = torch.autograd.grad(expect, h, g)
    torch.testing.assert_close(gh, ge, rtol=1e-6, atol=1e-6)
    # eval mode, or keeping the whole sequence: the plain layers
    net.eval()
    torch.testing.assert_close(net(h, mask), _plain(ref_blocks, h, mask))
    net.train()
    sched.set_current_seq(seq)
    torch.testing.assert_close(net(h, mask), _plain(ref_blocks, h, mask))
    # state dicts load into the unwrapped model
    plain = _Net(d, 2)
    plain.load_state_dict(strip_token_drop_keys(net.state_dict()))
    with pytest.raises(ValueError, match="random_ltd_layer_num is 3"):
        attach_schedule(net, {**config, "random_ltd_layer_num": 3}, sched)


def copy_block(block):
    import copy

    return copy.deepcopy(block)


def _plain(blocks, h, mask):
    for b in blocks:
        h = b(h, attention_mask=mask)
    return h


# --------------------------------------------------------------------------- DeepSpeed's paths
_PROBE = r"""
import numpy as np, torch
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed.runtime.data_pipeline.constants import CURRICULUM_LEARNING_MIN_DIFFICULTY, RANDOM_LTD_LAYER_ID
from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (MMapIndexedDataset,
    MMapIndexedDatasetBuilder, make_builder, make_dataset)
from deepspeed.runtime.data_pipeline.data_sampling.utils import find_fit_int_dtype, split_index
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config
from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from deepspeed.runtime.data_pipeline.data_routing.helper import (convert_to_random_ltd,
    remove_random_ltd_state_dict, save_without_random_ltd)
assert CURRICULUM_LEARNING_MIN_DIFFICULTY == "min_difficulty" and RANDOM_LTD_LAYER_ID == "random_ltd_layer_id"
de = get_data_efficiency_config({"data_efficiency": {"enabled": True}})
assert de["seed"] == 1234 and de["data_sampling"]["num_epochs"] == 1000 and not de["data_routing"]["random_ltd"]["enabled"]
plain = DeepSpeedDataSampler(de, 10, 2, 0, 1, None, 1, 0)  # curriculum off: an empty sampler of 10000 samples
assert len(plain) == 10000
s = CurriculumScheduler({"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
                         "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}})
assert [s.update_difficulty(n) for n in range(1, 5)] == [2, 4, 4, 6]
b = make_builder("tok.bin", impl="mmap", vocab_size=50000)
b.add_item(torch.tensor([7, 8])); b.end_document(); b.finalize("tok.idx")
d = make_dataset("tok", "infer", skip_warmup=True)
assert isinstance(d, MMapIndexedDataset) and d.dtype == np.uint16 and list(d[0]) == [7, 8]
try:
    make_builder("x.bin", impl="cached")
    raise SystemExit("legacy format accepted")
except ValueError as e:
    assert "not supported by shardwise" in str(e)
assert find_fit_int_dtype(0, 300) is np.uint16 and split_index(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
convert_to_random_ltd(net, torch.nn.Linear)
assert isinstance(net[0], RandomLayerTokenDrop) and set(save_without_random_ltd(net)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
print("ok")
"""


def test_deepspeed_data_pipeline_paths(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "compat" / "deepspeed"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --------------------------------------------------------------------------- engine: data_efficiency config
class _SeenBlock(torch.nn.Module):
    def __init__(self, d, seen):
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(d, d), seen

    def forward(self, h, attention_mask=None):
        self.seen.append(h.shape[1])
        return torch.tanh(self.lin(h))


def test_engine_runs_random_ltd_from_the_config():
    import shardwise

    torch.manual_seed(0)
    seen: list[int] = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(_SeenBlock(4, seen) for _ in range(3))

        def forward(self, h):
            for layer in self.layers:
                h = layer(h, attention_mask=None)
            return h.pow(2).mean()

    ltd = {"enabled": True, "total_layer_num": 3, "random_ltd_layer_num": 2, "random_ltd_layer_id": [0, 1],
           "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
           "random_ltd_schedule": {"min_value": 4, "max_value": 16, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 6, "seq_per_step": 4}}}
    engine, *_ = shardwise.initialize(model=Net(), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}})
    assert engine.random_ltd_enabled() and not engine.curriculum_learning_enabled()
    wrap_layers(engine.module, _SeenBlock)
    engine.random_ltd_initialize()  # what DeepSpeed's convert_to_random_ltd(engine, ...) calls
    kept = []
    for _ in range(8):
        seen.clear()
        loss = engine(torch.randn(2, 16, 4))
        engine.backward(loss)
        engine.step()
        kept.append(list(seen))
    # DeepSpeed's fixed_linear at global steps 0..7: floor(4 + 12 * step / 6) rounded down to a multiple of 4
    expected = [4, 4, 8, 8, 12, 12, 16, 16]
    assert kept == [[k, k, 16] for k in expected]  # the third layer is not a random-LTD layer
    assert engine.random_ltd_scheduler.state_dict()["current_value"] == 16
    engine.eval()
    seen.clear()
    engine(torch.randn(2, 16, 4))
    assert seen == [16, 16, 16]


# --------------------------------------------------------------------------- curriculum data sampling
_SAMPLER_LENS = [(i * 7) % 13 + 1 for i in range(40)]  # metric values 1..13
# DeepSpeed 0.19.8's DeepSpeedDataSampler on the analyzer's files below (micro-batch 2, 2 accumulation steps,
# one data-parallel rank, seed 1234): the first 14 micro-batches and the difficulty reached
_DS_BATCHES = {
    "value": ([[15, 32], [19, 0], [10, 28], [30, 26], [2, 14], [17, 34], [38, 21], [13, 4], [23, 39], [31, 6], [17, 27], [6, 8], [29, 33], [9, 0]], 13),
    "percentile": ([[15, 30], [17, 0], [26, 2], [28, 10], [12, 13], [6, 4], [1, 3], [39, 15], [17, 4], [23, 19], [16, 34], [20, 8], [31, 29], [30, 11]], 4),
}


def _sampling_config(root, kind):
    metric = {"index_to_sample_path": f"{root}/an/seqlen/seqlen_index_to_sample",
              "index_to_metric_path": f"{root}/an/seqlen/seqlen_index_to_metric",
              "difficulty_type": kind, "clustering_type": "schedule_based",
              "min_difficulty": 3 if kind == "value" else 1, "max_difficulty": 13 if kind == "value" else 4,
              "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 2 if kind == "value" else 1}}
    if kind == "percentile":
        metric["index_to_sample_path"] = f"{root}/an/seqlen/seqlen_index_to_sample_percentile_merged"
    return {"enabled": True, "seed": 1234, "data_sampling": {
        "enabled": True, "curriculum_learning": {"enabled": True, "data_cluster_path": f"{root}/clusters_{kind}",
                                                 "curriculum_metrics": {"seqlen": metric}}}}


def _analyze_lengths(root):
    DatasetAnalyzer([torch.tensor([n]) for n in _SAMPLER_LENS], batch_size=8, metric_names=["seqlen"],
                    metric_functions=[lambda b: b[:, 0].clone()], metric_types=["single_value_per_sample"],
                    metric_dtypes=[torch.int64], save_path=f"{root}/an").run_map_reduce()


@pytest.mark.parametrize("kind", ["value", "percentile"])
def test_curriculum_sampler_draws_deepspeeds_batches(tmp_path, kind):
    from shardwise.data.curriculum_sampler import CurriculumSampler
    from shardwise.data.efficiency import data_efficiency_settings

    _analyze_lengths(tmp_path)
    sampler = CurriculumSampler(data_efficiency_settings(_sampling_config(tmp_path, kind)), len(_SAMPLER_LENS), 2, 0,
                                1, None, 2, 0)
    batches = []
    for i, batch in enumerate(sampler):
        batches.append([int(x) for x in batch])
        if i == 13:
            break
    expected, difficulty = _DS_BATCHES[kind]
    assert batches == expected and sampler.current_difficulties == {"seqlen": difficulty}
    if kind == "value":  # every sample drawn was allowed by the difficulty of its global batch
        schedule = CurriculumSchedule(_sampling_config(tmp_path, kind)["data_sampling"]["curriculum_learning"]
                                      ["curriculum_metrics"]["seqlen"])
        for step, pair in enumerate(zip(batches[::2], batches[1::2]), start=1):
            allowed = schedule.update_difficulty(step)
            assert all(_SAMPLER_LENS[i] <= allowed for micro in pair for i in micro)


def test_engine_loader_samples_by_difficulty_and_post_processes(tmp_path):
    import shardwise

    _analyze_lengths(tmp_path)
    seen = []

    def post(batch, state):
        seen.append(dict(state["current_difficulties"]))
        return batch

    engine, _, loader, _ = shardwise.initialize(
        model=torch.nn.Linear(1, 1), training_data=[torch.tensor([float(i)]) for i in range(40)],
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "data_efficiency": _sampling_config(tmp_path, "value")})
    assert engine.curriculum_learning_enabled() and loader is engine.training_dataloader
    engine.set_data_post_process_func(post)
    got = []
    for i, batch in enumerate(loader):
        got.append(batch.reshape(-1).long().tolist())
        if i == 13:
            break
    # the first global batch is curriculum step 1: floor(3 + 10 / 6) = 4
    assert got == _DS_BATCHES["value"][0] and seen[0] == {"seqlen": 4} and seen[-1] == {"seqlen": 13}


def test_data_efficiency_config_refuses_what_is_not_implemented_by_name():
    from shardwise.config import ConfigError, load_config

    on = {"enabled": True}
    for block, path in (({"data_sampling": {"dynamic_batching": on}}, "data_sampling.dynamic_batching"),
                        ({"data_routing": {"random_ltd": {**on, "layer_token_lr_schedule": on}}},
                         "data_routing.random_ltd.layer_token_lr_schedule")):
        with pytest.raises(ConfigError, match=f"not implemented yet: data_efficiency.{path}"):
            load_config({"data_efficiency": {"enabled": True, **block}}).check_supported()
    load_config({"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": on}}}).check_supported()
    load_config({"data_efficiency": {"enabled": True, "seed": 3}}).check_supported()
