"""Compare the log histories ``examples/trl/train.py --losses`` wrote under two ``deepspeed`` packages.

    python examples/trl/compare.py OUT          # OUT/compat-<trainer>-z<stage>.json vs OUT/deepspeed-...json

Prints, per run, the losses of both and the largest relative difference over every logged number (loss,
grad_norm, rewards, log-probs, kl, ...; timings left out). Exits 1 when a difference exceeds --rtol or a
run is missing on one side only; runs missing on both sides are listed and skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

RUNS = [(t, z) for t in ("sft", "dpo", "grpo") for z in (2, 3)]
TIMING = ("runtime", "per_second", "step_time")


def numbers(entry: dict) -> dict[str, float]:
    return {k: float(v) for k, v in entry.items()
            if isinstance(v, (int, float)) and not any(t in k for t in TIMING)}


def worst(a: list[dict], b: list[dict], floor: float) -> tuple[float, str]:
    """The largest |x - y| / max(|x|, |y|, floor): quantities near zero (a reward margin of 4e-4, a GRPO loss
    of 1e-7, differences of nearly equal numbers) are measured against ``floor`` instead of themselves."""
    if len(a) != len(b):
        return float("inf"), f"{len(a)} vs {len(b)} log entries"
    out, where = 0.0, ""
    for step, (x, y) in enumerate(zip(map(numbers, a), map(numbers, b)), 1):
        for key in sorted(x.keys() & y.keys()):
            diff = abs(x[key] - y[key]) / max(abs(x[key]), abs(y[key]), floor)
            if diff > out:
                out, where = diff, f"{key} @ entry {step}"
    return out, where


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--floor", type=float, default=0.1, help="magnitude below which differences count as absolute")
    p.add_argument("--compat_only", action="store_true", help="no DeepSpeed runs: list the compat losses only")
    a = p.parse_args()
    bad = 0
    print(f"{'run':10} {'ZeRO (ref)':10} {'losses: shardwise compat':40} {'losses: DeepSpeed 0.19.8':40} max rel diff")
    for trainer, stage in RUNS:
        paths = [os.path.join(a.out, f"{side}-{trainer}-z{stage}.json") for side in ("compat", "deepspeed")]
        have = [os.path.exists(q) for q in paths]
        if not any(have):
            print(f"{trainer:10} {stage:<10} not run")
            continue
        if a.compat_only and have[0]:
            c = json.load(open(paths[0]))
            print(f"{trainer:10} {c['stage']!s:10} " + " ".join(f"{h['loss']:.6g}" for h in c["history"] if "loss" in h))
            continue
        if not all(have):
            print(f"{trainer:10} {stage:<10} missing {paths[have.index(False)]}")
            bad += 1
            continue
        c, d = (json.load(open(q)) for q in paths)
        steps = [h for h in c["history"] if "loss" in h], [h for h in d["history"] if "loss" in h]
        diff, where = worst(*steps, a.floor)
        fmt = lambda hs: " ".join(f"{h['loss']:.6g}" for h in hs)  # noqa: E731
        z = f"{c['stage']} ({c['ref_stage']})" if c.get("ref_stage") is not None else f"{c['stage']}"
        print(f"{trainer:10} {z:10} {fmt(steps[0]):40} {fmt(steps[1]):40} {diff:.1e} {where}")
        bad += diff > a.rtol
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
