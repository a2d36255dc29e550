"""``deepspeed.moe``: mixture-of-experts is not implemented by shardwise. ``deepspeed.moe.layer.MoE`` can
be imported (scripts and test helpers import it next to dense models) but building one raises."""
