"""``deepspeed.moe.layer``: ``MoE`` as a name whose construction says that shardwise has no MoE."""
import torch

REASON = ("mixture-of-experts layers and expert parallelism are not implemented by shardwise "
          "(deepspeed.moe.layer.MoE). See docs/deepspeed-compat.md")


class MoE(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(REASON)


__all__ = ["MoE"]
