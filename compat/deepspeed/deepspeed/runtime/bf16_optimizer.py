"""``deepspeed.runtime.bf16_optimizer``: the name only. DeepSpeed wraps the optimizer in ``BF16_Optimizer``
for bf16 at ZeRO stage 0/1; shardwise's engine keeps the optimizer you gave (or the config built) and does
bf16's master weights and gradient accumulation in its precision step, so ``engine.optimizer`` is never
a ``BF16_Optimizer``."""


class BF16_Optimizer:  # noqa: N801 - DeepSpeed's name
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not provided by shardwise: enable bf16 in the "
            "config ({'bf16': {'enabled': true}}); the engine keeps the optimizer itself. See docs/deepspeed-compat.md")


__all__ = ["BF16_Optimizer"]
