"""Batch-size elasticity, as DeepSpeed computes it (``deepspeed.elasticity``, versions 0.1 and 0.2).

From the ``elasticity`` config block (``max_train_batch_size``, ``micro_batch_sizes``, ``min_gpus``,
``max_gpus``, ``prefer_larger_batch``, ``version``, ``num_gpus_per_node``, ``model_parallel_size``)
it picks one global batch size that divides evenly over as many GPU counts as possible, so a job
can be restarted on another number of GPUs (``shardwise run --elastic MIN:MAX``) and train on the
same global batch: only the gradient accumulation steps change. DeepSpeed 0.19 removed the block;
its last implementation (0.18) is what this reproduces, number for number.

Version 0.1 tries, as base sizes, every micro-batch size and their least common multiple, scales each
by the largest highly composite number that keeps it within ``max_train_batch_size``, and keeps the
candidate with the most valid GPU counts in ``[min_gpus, max_gpus]`` (ties: the larger batch, or the
smaller with ``prefer_larger_batch: false``). Version 0.2 does this per node (``num_gpus_per_node /
model_parallel_size`` data-parallel ranks each) and, for a world size outside the list, falls back to
the largest multiple of ``micro_batch * current_dp_size`` within ``max_train_batch_size``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from functools import reduce

logger = logging.getLogger("shardwise")

LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"

# The smallest highly composite numbers: enough for batch sizes up to ~720K.
HCN_LIST = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
            15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
            498960, 554400, 665280, 720720]


class ElasticityError(Exception):
    """Elasticity cannot be used as configured."""


class ElasticityConfigError(ElasticityError, ValueError):
    """The ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError, ValueError):
    """The running world size is not one the elastic batch size divides over."""


def _block(ds_config: dict) -> dict:
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dictionary but received a {type(ds_config)}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("'elasticity' is missing from the config; add it to run an elastic job")
    block = ds_config["elasticity"]
    if not block.get("enabled", False):
        raise ElasticityConfigError("elasticity is disabled: set elasticity.enabled true to run an elastic job")
    return _validated(block)


def _validated(block: dict) -> dict:
    """The block with defaults filled in; ElasticityConfigError naming a bad or missing key."""
    from pydantic import ValidationError

    from shardwise.config.monitors import ElasticityConfig

    for key in ("max_train_batch_size", "micro_batch_sizes"):
        if key not in block:
            raise ElasticityConfigError(f"elasticity.{key} is required when elasticity is enabled")
    micro = block["micro_batch_sizes"]
    if not isinstance(micro, list) or not micro or \
            not all(isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in micro):
        raise ElasticityConfigError(f"elasticity.micro_batch_sizes {micro!r}: expected a list of positive integers")
    try:
        return ElasticityConfig.model_validate(block).model_dump()
    except ValidationError as exc:
        raise ElasticityConfigError(f"elasticity: {exc}") from None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _candidate_batch_sizes(bases: list[int], max_batch: int) -> list[int]:
    out = set()
    for base in bases:
        size = base
        for hcn in HCN_LIST:
            if base * hcn > max_batch:
                break
            size = base * hcn
        out.add(size)
    return list(out)


def _valid_gpus(batch_size: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    valid = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        most = batch_size // micro
        if min_gpus <= most <= max_gpus:
            valid.add(most)
        for i in range(1, most // 2 + 1):
            if most % i == 0 and min_gpus <= i <= max_gpus:
                valid.add(i)
    return sorted(valid)


def _best(candidates, micro_batches, min_gpus, max_gpus, prefer_larger):
    best_count, best_gpus, best_size = 0, None, int(min(micro_batches))
    for size in candidates:
        gpus = _valid_gpus(size, micro_batches, min_gpus, max_gpus)
        better_tie = (prefer_larger and size > best_size) or (not prefer_larger and size < best_size)
        if len(gpus) > best_count or (len(gpus) == best_count and better_tie):
            best_count, best_gpus, best_size = len(gpus), gpus, size
    return best_size, best_gpus


def _compatible_gpus_v01(micro_batches, max_acceptable_batch_size, min_gpus=None, max_gpus=None, prefer_larger=True):
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    if not all(mb <= max_acceptable_batch_size for mb in micro_batches):
        raise ElasticityConfigError(f"elasticity.micro_batch_sizes {micro_batches}: every micro-batch size must be "
                                    f"at most max_train_batch_size ({max_acceptable_batch_size})")
    lcm = reduce(lambda a, b: a * b // math.gcd(a, b), micro_batches)
    candidates = _candidate_batch_sizes(list(micro_batches) + [lcm], max_acceptable_batch_size)
    return _best(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _compatible_gpus_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus=None, max_gpus=None,
                         prefer_larger=True, num_gpus_per_node=1, model_parallel_size=1):
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"elasticity.num_gpus_per_node ({num_gpus_per_node}) must be divisible by "
                              f"elasticity.model_parallel_size ({model_parallel_size})")

    def micro_for(batch):
        pick = None
        for micro in micro_batches:
            if batch // current_num_gpus % micro == 0:
                if pick is None or (prefer_larger and pick < micro):
                    pick = micro
        return pick

    dp_per_node = num_gpus_per_node // model_parallel_size
    batch, valid_nodes = _compatible_gpus_v01(micro_batches, int(max_acceptable_batch_size / dp_per_node),
                                              int(min_gpus / num_gpus_per_node), int(max_gpus / num_gpus_per_node),
                                              prefer_larger=prefer_larger)
    batch = int(batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, micro_for(batch)
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    candidates = [math.floor(max_acceptable_batch_size / float(m * current_dp)) * m * current_dp for m in micro_batches]
    batch = max(candidates) if prefer_larger else min(candidates)
    return batch, [int(current_dp)], micro_for(batch)


def elasticity_enabled(ds_config: dict) -> bool:
    return bool(ds_config.get("elasticity", {}).get("enabled", False))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """The scheduler's elastic config (``DEEPSPEED_ELASTICITY_CONFIG``) must match the runtime's."""
    if DEEPSPEED_ELASTICITY_CONFIG not in os.environ:
        logger.warning("%s is not set: cannot check that the scheduler scales this job to compatible GPU counts",
                       DEEPSPEED_ELASTICITY_CONFIG)
        return
    from shardwise.config.monitors import ElasticityConfig

    raw = json.loads(os.environ[DEEPSPEED_ELASTICITY_CONFIG])
    raw = raw.get("elasticity", raw)  # the whole config or just its block
    seen = ElasticityConfig.model_validate(raw)
    mine = ElasticityConfig.model_validate(runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(seen, key) != getattr(mine, key):
            raise ElasticityConfigError(f"elasticity.{key}: the resource scheduler saw {getattr(seen, key)!r}, "
                                        f"the runtime config has {getattr(mine, key)!r}")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size=0, return_microbatch=False):
    """``(train_batch_size, valid_gpu_counts)`` for the config's ``elasticity`` block, and the
    micro-batch size as a third value when ``world_size`` > 0 (or ``return_microbatch``).
    Deterministic for a given config. ``target_deepspeed_version`` is accepted for DeepSpeed's
    signature (every shardwise version computes the same numbers)."""
    block = _block(ds_config)
    if _version_tuple(target_deepspeed_version) < _version_tuple(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"target version {target_deepspeed_version} is older than {MINIMUM_DEEPSPEED_VERSION}, "
                              "the first with elasticity")
    version = float(block["version"])
    mp, per_node = block["model_parallel_size"], block["num_gpus_per_node"]
    if mp > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.version {version} does not support model parallelism "
                                    f"(elasticity.model_parallel_size {mp}); use version 0.2")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity.version {version}: only versions up to "
                                    f"{LATEST_ELASTICITY_VERSION} exist")
    micro_batches = block["micro_batch_sizes"]
    common = dict(micro_batches=micro_batches, max_acceptable_batch_size=block["max_train_batch_size"],
                  min_gpus=block["min_gpus"], max_gpus=block["max_gpus"], prefer_larger=block["prefer_larger_batch"])
    candidate_micro = None
    if version == 0.1:
        batch, valid = _compatible_gpus_v01(**common)
    elif version == 0.2:
        current = world_size
        if not current:
            raw = os.environ.get("WORLD_SIZE", "")
            if not raw.isnumeric():
                raise ElasticityConfigError("elasticity version 0.2 needs the world size: pass world_size= or set "
                                            f"WORLD_SIZE (it is {raw or 'unset'})")
            current = int(raw)
        batch, valid, candidate_micro = _compatible_gpus_v02(current_num_gpus=current, num_gpus_per_node=per_node,
                                                             model_parallel_size=mp, **common)
    else:
        raise ElasticityConfigError(f"elasticity.version {version}: expected 0.1 or 0.2")
    batch = int(batch)
    logger.info("Valid World Size (GPUs / Model Parallel Size): %s", valid)
    if world_size > 0:
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(f"world size {world_size} is not one the elastic batch size "
                                                  f"{batch} divides over: valid GPU counts are {valid}")
        return batch, valid, _largest_micro(batch, world_size, micro_batches)
    if return_microbatch:
        return batch, valid, candidate_micro if version == 0.2 else _largest_micro(batch, world_size, micro_batches)
    return batch, valid


def _largest_micro(batch: int, world_size: int, micro_batches: list[int]) -> int:
    for micro in sorted(set(micro_batches), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityError(f"no micro-batch size in {micro_batches} divides {batch} // {world_size}")


def elastic_batch_sizes(config, dp_world_size: int):
    """The batch triad the ``elasticity`` block gives for ``dp_world_size`` ranks (used by the engine).
    Batch keys set outside the block are an error unless ``ignore_non_elastic_batch_info``."""
    from shardwise.config.batch import BatchSizes

    block = config.elasticity
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if getattr(config, k) is not None]
    if given and not block.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(f"{', '.join(given)} set next to an enabled 'elasticity' block, which computes "
                                    "them: remove them or set elasticity.ignore_non_elastic_batch_info true")
    ensure_immutable_elastic_config(block.model_dump())
    batch, valid, micro = compute_elastic_config({"elasticity": block.model_dump()}, "0.19.8", world_size=dp_world_size)
    if given:
        logger.warning("elasticity: ignoring %s; using train_batch_size %d, micro batch %d for %d ranks",
                       ", ".join(given), batch, micro, dp_world_size)
    return BatchSizes(batch, micro, batch // (micro * dp_world_size))
