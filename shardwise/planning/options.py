"""``shardwise plan``'s flags (no torch import: ``shardwise --help`` stays fast)."""

from __future__ import annotations

import argparse


def parse_bytes(text: str) -> int:
    """``80GB`` / ``80GiB`` / ``80e9`` / ``85899345920`` -> bytes (GB = 1e9, GiB = 2^30)."""
    units = {"kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4,
             "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu_memory {text!r}: a byte count such as 80GiB, 80GB or 85899345920")


def parse_ranks(text: str) -> list[int]:
    """``0,7,100-103`` -> [0, 7, 100, 101, 102, 103]."""
    out = []
    try:
        for item in filter(None, text.split(",")):
            lo, _, hi = item.partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: comma-separated ranks and ranges, e.g. 0,7,100-103")
    return out


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, required=True, help="number of ranks (GPUs) of the run")
    parser.add_argument("--gpus_per_node", type=int, required=True, help="ranks per node")
    parser.add_argument("--model", required=True,
                        help="a Hugging Face config folder (config.json), or the reference GPT as "
                             "gpt:hidden=H,n_layers=L,n_heads=A,vocab_size=V,seq_len=S")
    parser.add_argument("--config", required=True, help="the DeepSpeed/shardwise JSON config of the run")
    parser.add_argument("--gpu_memory", type=parse_bytes, default=None,
                        help="device memory per GPU (e.g. 80GiB); ranks needing more are named and the "
                             "command exits 1")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the plan as JSON to OUT")
    parser.add_argument("--ranks", type=parse_ranks, default=None, metavar="SAMPLE",
                        help="ranks to report, e.g. 0,7,100-103 (default: all up to 4096, else a sample: "
                             "the ends of every stage and node)")
    parser.add_argument("--pipe", type=int, default=1,
                        help="pipeline stages (the PipelineModule's num_stages; reference GPT only)")
    parser.add_argument("--partition_method", default="parameters",
                        help="the PipelineModule's partition_method (parameters, uniform, type:REGEX)")
    parser.add_argument("--seq_len", type=int, default=None,
                        help="tokens per sample (default: the GPT's seq_len, or min(max_position_embeddings, 4096))")
    parser.add_argument("--activation_checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="estimate activations with full checkpointing (default: on when the config has an "
                             "activation_checkpointing block)")
