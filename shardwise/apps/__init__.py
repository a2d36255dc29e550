"""Applications built on shardwise's public API: chat fine-tuning and serving.

``python -m shardwise.apps.finetune`` / ``shardwise finetune`` (see :mod:`shardwise.apps.finetune`)
and ``python -m shardwise.apps.serve`` / ``shardwise serve`` (see :mod:`shardwise.apps.serve`).
Nothing in shardwise imports this package.
"""
