"""``deepspeed.ops.transformer``: DeepSpeed's fused transformer layer as a plain PyTorch module
(shardwise.models.transformer_layer), and the names of its kernel-injected inference layers, which
shardwise does not have (they refuse when built)."""
from deepspeed._name_only import name_only

from .transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

_WHY = ("kernel injection (DeepSpeed-Inference's fused CUDA transformer kernels) is not implemented; use "
        "shardwise.init_inference (AutoTP) on the Hugging Face model")
DeepSpeedInferenceConfig = name_only(__name__, "DeepSpeedInferenceConfig", _WHY)
DeepSpeedTransformerInference = name_only(__name__, "DeepSpeedTransformerInference", _WHY)
DeepSpeedMoEInferenceConfig = name_only(__name__, "DeepSpeedMoEInferenceConfig", _WHY)
DeepSpeedMoEInference = name_only(__name__, "DeepSpeedMoEInference", _WHY)

__all__ = ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig", "DeepSpeedInferenceConfig",
           "DeepSpeedTransformerInference", "DeepSpeedMoEInferenceConfig", "DeepSpeedMoEInference"]
