"""``deepspeed.runtime.data_pipeline.config``: DeepSpeed's reader of the ``data_efficiency`` block."""
from shardwise.data.efficiency import data_efficiency_settings


def get_data_efficiency_config(param_dict):
    """The ``data_efficiency`` block of a whole DeepSpeed config dict, with DeepSpeed's defaults filled in."""
    return data_efficiency_settings(param_dict.get("data_efficiency"))


def get_data_efficiency_enabled(param_dict):
    return get_data_efficiency_config(param_dict)["enabled"]


def get_data_efficiency_seed(param_dict):
    return get_data_efficiency_config(param_dict)["seed"]


__all__ = ["get_data_efficiency_config", "get_data_efficiency_enabled", "get_data_efficiency_seed"]
