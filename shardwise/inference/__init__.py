"""``shardwise.init_inference``: AutoTP-sharded inference of Hugging Face models (DeepSpeed's
``deepspeed.inference``, without kernel injection)."""

from shardwise.inference.engine import InferenceEngine, init_inference, inference_config  # noqa: F401
