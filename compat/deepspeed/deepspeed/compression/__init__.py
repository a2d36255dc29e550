"""``deepspeed.compression``: DeepSpeed 0.19.8 removed the compression library and kept only ``helper``
(``recursive_getattr``/``recursive_setattr``, which DeepSpeed-Chat imports); so does this package."""
