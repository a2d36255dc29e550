"""``deepspeed.elasticity``: batch-size elasticity (``compute_elastic_config``)."""

from shardwise.elasticity.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)

__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "compute_elastic_config",
           "elasticity_enabled", "ensure_immutable_elastic_config"]
