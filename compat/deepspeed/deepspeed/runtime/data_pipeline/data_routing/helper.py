"""``deepspeed.runtime.data_pipeline.data_routing.helper``: wrap layers for random-LTD and drop the
wrapper level from state dicts."""
from shardwise.data.random_ltd import strip_token_drop_keys as remove_random_ltd_state_dict
from shardwise.data.random_ltd import wrap_layers

__all__ = ["convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict"]


def convert_to_random_ltd(model, convert_type):
    """Wrap every ``convert_type`` submodule of ``model`` (an engine or a module) in
    ``RandomLayerTokenDrop``; an engine then attaches its random-LTD schedule
    (``model.random_ltd_initialize()``)."""
    wrap_layers(getattr(model, "module", model), convert_type)
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def save_without_random_ltd(model):
    """``model``'s state dict (an engine's module's) with the random-LTD wrapper level removed from its keys."""
    return remove_random_ltd_state_dict(getattr(model, "module", model).state_dict())
