"""``deepspeed.runtime.tensor_parallel``: only ``config._get_hf_tp_plan`` (the Hugging Face tp_plan AutoTP
follows, ``shardwise.tensor_parallel.autotp.hf_tp_plan``); the ``tensor_parallel`` config block is shardwise's
(``shardwise.config``)."""
