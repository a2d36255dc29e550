"""On-policy rollouts for RL / distillation training: prompts in, prompt + sampled response out.

``rollout(engine, prompt_ids, prompt_attention_mask, ...)`` generates through the model's ``generate``
as the engine holds it. With the hybrid engine (``"hybrid_engine": {"enabled": true}``,
``shardwise.runtime.hybrid_engine``) that call gathers the ZeRO-3 parameters once and fuses the LoRA
layers for the whole generation; with a plain engine the model's own ``generate`` runs (ZeRO-3 then
gathers around each module's forward).

The layout of the result is the one DeepSpeed's rollout interface uses (``deepspeed.runtime.rollout``):

- prompts arrive left-padded, ``[B, T_p]``, with their attention mask;
- each prompt is repeated ``n_samples`` times (``repeat_interleave``: a prompt's samples are adjacent);
- the result is ``[B * n_samples, T_p + max_new_tokens]``: the prompt columns, then the response;
  every response starts at column ``T_p``;
- generation runs for exactly ``max_new_tokens`` steps on every rank (the end-of-sequence token does not
  stop it, so ZeRO-3 ranks run the same number of gathers); afterwards each response keeps its first
  end-of-sequence token and every later position becomes padding, with attention 0.
"""

from __future__ import annotations

import torch

__all__ = ["generalized_jsd", "pad_after_eos", "response_targets", "rollout"]


def pad_after_eos(output_ids: torch.Tensor, response_start: int, eos_token_id, pad_token_id: int):
    """``(ids, response_mask)``: each response (columns from ``response_start``) keeps its first
    end-of-sequence token and is padded after it; the mask is 1 on the response tokens kept (the first
    end-of-sequence token included, even when it equals the padding token), 0 elsewhere.
    ``eos_token_id`` may be one id, a list of ids, or None (nothing is cut)."""
    response = output_ids[:, response_start:]
    kept = response != pad_token_id
    if eos_token_id is None or response.shape[1] == 0:
        return output_ids, kept.long()
    eos = torch.as_tensor(eos_token_id, device=response.device, dtype=response.dtype).flatten()
    is_eos = (response.unsqueeze(-1) == eos).any(dim=-1)
    has_eos = is_eos.any(dim=-1, keepdim=True)
    first = is_eos.long().argmax(dim=-1, keepdim=True)
    pos = torch.arange(response.shape[1], device=response.device).unsqueeze(0)
    after = has_eos & (pos > first)
    at = has_eos & (pos == first)
    output_ids = output_ids.clone()
    output_ids[:, response_start:].masked_fill_(after, pad_token_id)
    return output_ids, ((kept | at) & ~after).long()


@torch.no_grad()
def rollout(engine, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int,
            pad_token_id: int, eos_token_id=None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            n_samples: int = 1):
    """Sample ``n_samples`` responses of ``max_new_tokens`` tokens per left-padded prompt with the model
    ``engine.module`` (see the module docstring for the layout). ``temperature <= 0`` decodes greedily;
    ``top_k <= 0`` turns top-k filtering off. Returns ``(input_ids, attention_mask, response_start)``:
    ``[B * n_samples, T_p + max_new_tokens]`` twice and the response's first column."""
    if prompt_ids.dim() != 2 or prompt_attention_mask.shape != prompt_ids.shape:
        raise ValueError(f"rollout: prompt_ids must be 2-D [B, T_p] with an attention mask of the same shape; got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_attention_mask.shape)}")
    if max_new_tokens < 1 or n_samples < 1:
        raise ValueError(f"rollout: max_new_tokens ({max_new_tokens}) and n_samples ({n_samples}) must be >= 1")
    module = engine.module
    generate = getattr(module, "generate", None)
    if generate is None:
        raise ValueError(f"rollout: the model ({type(module).__name__}) has no generate() method")
    if n_samples > 1:
        prompt_ids = prompt_ids.repeat_interleave(n_samples, dim=0)
        prompt_attention_mask = prompt_attention_mask.repeat_interleave(n_samples, dim=0)
    prompt_len = prompt_ids.shape[1]
    sample = temperature > 0.0
    kwargs = {"attention_mask": prompt_attention_mask, "max_new_tokens": max_new_tokens,
              "eos_token_id": None, "pad_token_id": pad_token_id,
              "do_sample": sample}
    if sample:
        kwargs.update(temperature=max(temperature, 1e-8), top_p=top_p, top_k=max(top_k, 0))
    output_ids = generate(prompt_ids, **kwargs)
    output_ids, response_mask = pad_after_eos(output_ids, prompt_len, eos_token_id, pad_token_id)
    attention_mask = torch.empty_like(output_ids, dtype=torch.long)
    attention_mask[:, :prompt_len] = prompt_attention_mask
    attention_mask[:, prompt_len:] = response_mask
    return output_ids, attention_mask, prompt_len


def response_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: torch.Tensor):
    """The causal targets of a rollout for training on its responses only: ``(target_ids, response_mask)``,
    both one column shorter than ``input_ids`` (logits at position ``i`` predict ``target_ids[:, i]``,
    the token at ``i + 1``); the mask is 1 where that token is a kept response token (at or after the row's
    ``response_start`` and attended)."""
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device)
    in_response = positions.unsqueeze(0) >= response_start.unsqueeze(1)
    return input_ids[:, 1:], attention_mask[:, 1:].bool() & in_response


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor, *,
                    beta: float = 0.5, temperature: float = 1.0, teacher_top_k: int | None = None,
                    pointwise_clip: float | None = None):
    """The generalized Jensen-Shannon divergence of on-policy distillation, per response token, summed over
    the vocabulary and averaged over the tokens ``response_mask`` keeps: ``(loss, loss_sum, token_count)``.

    With ``S`` the student's and ``T`` the teacher's distribution (logits divided by ``temperature``) and
    the mixture ``M = beta * T + (1 - beta) * S``, the divergence is
    ``beta * KL(T || M) + (1 - beta) * KL(S || M)``; its ends are the two KL divergences themselves:
    ``beta = 0`` is ``KL(T || S)`` (forward), ``beta = 1`` is ``KL(S || T)`` (reverse).
    ``teacher_top_k`` keeps, at each position, only the teacher's ``k`` likeliest tokens (both
    distributions renormalised over them); ``pointwise_clip`` caps each token's contribution to the sum
    over the vocabulary."""
    student = student_logits / temperature
    teacher = teacher_logits / temperature
    if teacher_top_k is not None:
        keep = teacher.topk(teacher_top_k, dim=-1).indices
        student, teacher = student.gather(-1, keep), teacher.gather(-1, keep)
    log_s = torch.log_softmax(student, dim=-1)
    log_t = torch.log_softmax(teacher, dim=-1)
    if beta == 0.0:
        pointwise = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        pointwise = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_s + torch.log1p(torch.tensor(-beta, dtype=log_s.dtype, device=log_s.device)),
                                log_t + torch.log(torch.tensor(beta, dtype=log_t.dtype, device=log_t.device)))
        pointwise = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    if pointwise_clip is not None:
        pointwise = pointwise.clamp(max=pointwise_clip)
    mask = response_mask.to(pointwise.dtype)
    loss_sum = (pointwise.sum(dim=-1) * mask).sum()
    count = mask.sum().to(torch.long)
    return loss_sum / count.clamp_min(1), loss_sum, count
