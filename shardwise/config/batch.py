"""The batch-size triad: train_batch_size = micro batch * accumulation steps * data-parallel size."""

from __future__ import annotations

import logging
from typing import NamedTuple

from .errors import ConfigError

__all__ = ["BatchSizes", "resolve_batch_sizes"]

logger = logging.getLogger("shardwise")

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
DP = "data-parallel world size"


class BatchSizes(NamedTuple):
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _divide(total: int, total_name: str, factors: list[tuple[str, int]], target: str) -> int:
    """total / product(factors), or a ConfigError showing why it does not divide."""
    product = 1
    for _, value in factors:
        product *= value
    if total % product:
        terms = " * ".join(f"{name} ({value})" for name, value in factors)
        shown = f"{terms} = {product}" if len(factors) > 1 else terms
        raise ConfigError(f"{total_name} ({total}) is not divisible by {shown}, so {target} cannot be inferred")
    return total // product


def resolve_batch_sizes(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                        *, dp_world_size: int) -> BatchSizes:
    """Fill in the missing members of the triad the way DeepSpeed does.

    Any two given values determine the third; only ``train_batch_size`` given means
    ``gradient_accumulation_steps`` 1; an unset ``gradient_accumulation_steps`` is 1.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ValueError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
    tbs, micro, gas, dp = train_batch_size, micro_batch, grad_accum, dp_world_size

    if tbs is not None and micro is not None and gas is not None:
        expected = micro * gas * dp
        if tbs != expected:
            raise ConfigError(f"{TBS} ({tbs}) != {MICRO} ({micro}) * {GAS} ({gas}) * {DP} ({dp}) = {expected}")
    elif tbs is not None and micro is not None:
        gas = _divide(tbs, TBS, [(MICRO, micro), (DP, dp)], GAS)
        logger.info("%s inferred: %d = %s (%d) / (%s (%d) * %s (%d))", GAS, gas, TBS, tbs, MICRO, micro, DP, dp)
    elif tbs is not None and gas is not None:
        micro = _divide(tbs, TBS, [(GAS, gas), (DP, dp)], MICRO)
        logger.info("%s inferred: %d = %s (%d) / (%s (%d) * %s (%d))", MICRO, micro, TBS, tbs, GAS, gas, DP, dp)
    elif tbs is not None:
        gas = 1
        micro = _divide(tbs, TBS, [(DP, dp)], MICRO)
        logger.info("%s not set: using 1; %s inferred: %d = %s (%d) / %s (%d)",
                    GAS, MICRO, micro, TBS, tbs, DP, dp)
    elif micro is not None:
        if gas is None:
            gas = 1
            logger.info("%s not set: using 1", GAS)
        tbs = micro * gas * dp
        logger.info("%s inferred: %d = %s (%d) * %s (%d) * %s (%d)", TBS, tbs, MICRO, micro, GAS, gas, DP, dp)
    else:
        raise ConfigError(f"set {TBS} or {MICRO} (at least one of them is required; "
                          f"the batch size cannot be inferred from {GAS} alone)")
    return BatchSizes(tbs, micro, gas)
