"""``deepspeed.inference.quantization``: ZeRO-Inference's group-wise weight quantization at build time
(``utils``; ``zero.Init`` applies it when the config has ``weight_quantization.quantized_initialization``)."""
