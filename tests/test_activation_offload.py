"""Offloading the inputs of gradient-checkpointed Hugging Face layers (ALST's checkpoint offload):
bitwise-equal gradients, and the device tensors are really dropped in favour of host copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.runtime.activation_checkpointing.offload_activations import (  # noqa: E402
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)

LAYERS = 3


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _step(model, ids, ctx, inputs_seen=None):
    model.zero_grad(set_to_none=True)
    hooks = []
    if inputs_seen is not None:  # weak references to the memory of every layer's hidden_states input
        for layer in model.model.layers:
            hooks.append(layer.register_forward_pre_hook(
                lambda m, args: inputs_seen.append(weakref.ref(args[0].untyped_storage()))))
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        alive = [r() is not None for r in inputs_seen] if inputs_seen is not None else None
        loss.backward()
    for h in hooks:
        h.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, alive


def test_offloaded_layer_inputs_give_bitwise_equal_gradients_and_leave_the_device():
    import contextlib

    model = _llama()
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, alive_plain = _step(model, ids, contextlib.nullcontext(), inputs_seen=[])
    assert all(alive_plain)  # without offload, checkpointing keeps every layer's input

    ctx = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0)
    ctx._copy_cpu_tensors = True  # this machine has no accelerator: copy host tensors to exercise the path
    loss, grads, alive = _step(model, ids, ctx, inputs_seen=[])
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    # the inputs of all layers but the last (keep_last_count=1) now live only as host copies
    assert alive == [False] * (LAYERS - 1) + [True]
    s = ctx.stats
    per_layer = 2 * 48 * 32 * 4
    assert (s.marked_tensors, s.offloaded_tensors, s.restored_tensors, s.kept_last_tensors) == (LAYERS, LAYERS - 1,
                                                                                                LAYERS - 1, 1)
    assert s.offloaded_bytes == s.restored_bytes == (LAYERS - 1) * per_layer

    # on a CPU run without the test switch nothing is copied (as in DeepSpeed), gradients unchanged
    ctx = CheckpointHiddenStatesOffload(min_offload_bytes=0)
    loss, grads, _ = _step(model, ids, ctx)
    assert ctx.stats.offloaded_tensors == 0 and ctx.stats.skipped_marked_tensors == LAYERS
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    # the marker is removed from transformers when the last context exits
    assert "__call__" not in transformers.GradientCheckpointingLayer.__dict__


def test_offload_arguments_checked_and_no_reentry():
    with pytest.raises(ValueError, match="keep_last_count"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
    ctx = CheckpointHiddenStatesOffload()
    with ctx:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            ctx.__enter__()


def test_cpu_checkpointing_keeps_saved_inputs_as_host_copies(monkeypatch):
    """``activation_checkpointing.cpu_checkpointing`` (shardwise.checkpointing): the saved input of
    every checkpointed block is a host copy, the device tensor is dropped, gradients are bitwise equal."""
    from shardwise import checkpointing

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3))
    x = torch.randn(4, 32, 16)

    def run(cpu):
        checkpointing.configure(None, checkpoint_in_cpu=cpu)
        blocks.zero_grad(set_to_none=True)
        seen = []
        h = x.clone().requires_grad_()
        for b in blocks:
            h = b(h) * 1.0  # a fresh activation each block
            seen.append(weakref.ref(h.untyped_storage()))
            h = checkpointing.checkpoint(b, h)
        gc.collect()
        alive = [r() is not None for r in seen]
        h.sum().backward()
        return alive, [p.grad.clone() for p in blocks.parameters()], checkpointing.get_profile()["kept_bytes"]

    for name in ("_settings", "_configured"):  # restored after the test
        monkeypatch.setattr(checkpointing, name, getattr(checkpointing, name))
    monkeypatch.setattr(checkpointing, "_COPY_CPU_TENSORS", True)
    alive_ref, ref, kept_ref = run(False)
    alive, got, kept = run(True)
    assert all(alive_ref) and kept_ref == 0
    assert not any(alive) and kept == 3 * x.numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
