"""DeepSpeed's ``deepspeed.module_inject`` paths for AutoTP (``layers.LinearLayer``/``LinearAllreduce``,
``auto_tp.AutoTP``); kernel injection itself is not implemented."""
