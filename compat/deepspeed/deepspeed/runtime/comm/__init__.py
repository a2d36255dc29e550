"""``deepspeed.runtime.comm``: DeepSpeed's collective helpers (``coalesced_collectives``) on shardwise.comm."""
