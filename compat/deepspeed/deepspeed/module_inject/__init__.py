"""DeepSpeed's ``deepspeed.module_inject`` paths for AutoTP: ``layers`` (DeepSpeed's layer classes and their
universal-checkpoint metadata, over shardwise's AutoTP layers), ``tp_shard`` (the split arithmetic),
``auto_tp.AutoTP``; kernel injection itself is not implemented."""
