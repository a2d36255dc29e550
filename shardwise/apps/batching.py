"""Batched decoding for the chat server: concurrent requests are generated together.

One thread owns the model and runs steps. At each step boundary the requests that are waiting
(up to the free places) are *prefilled* together: their prompts, left-padded to the longest, go
through the model in one forward pass, filling a KV cache; they then join the running batch,
whose caches are left-padded to one length and stacked, so a decoding step is one forward pass
for every active request. A request leaves the batch when it reaches EOS, its token limit, its
deadline (``timeout``) or is cancelled (the client went away); the others go on.

One request's failure is its own: a prompt the model cannot take (the joint prefill is then
retried one request at a time), sampling settings that cannot be computed, or a streaming
consumer that raises fail that request with :class:`RequestFailed`; only an error in the
batched decoding step itself fails the requests in it.

    engine = BatchedGenerator(chat, max_batch_size=8)
    job = engine.submit(prompt_ids, limits, on_text=print, timeout=60)
    answer = job.result()            # or await asyncio.wrap_future(job.future)

``max_batch_size`` 1 gives one-at-a-time generation (the benchmark's reference).
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardwise.apps.generation import MIN_TEMPERATURE, Answer, ChatModel, GenerationLimits, _TextDeltas

__all__ = ["BatchedGenerator", "Job", "GenerationTimeout", "MIN_TEMPERATURE", "RequestFailed"]

logger = logging.getLogger("shardwise")


class RequestFailed(RuntimeError):
    """One request could not be generated (its own prompt or sampling settings); the others went on."""


class GenerationTimeout(TimeoutError):
    """The request's deadline passed; ``answer`` holds what was generated until then."""

    def __init__(self, seconds: float, answer: Answer) -> None:
        super().__init__(f"generation did not finish within the request timeout of {seconds:g} s")
        self.answer = answer


@dataclass
class Job:
    prompt_ids: list[int]
    limits: GenerationLimits
    on_text: Callable[[str], None] | None = None
    timeout: float | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    _deltas: _TextDeltas | None = None

    def cancel(self) -> None:
        """Stop generating at the next step boundary (the answer so far ends as "cancelled")."""
        self.cancelled.set()

    def result(self, timeout: float | None = None) -> Answer:
        return self.future.result(timeout)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout


class _Batch:
    """The running batch: stacked, left-padded KV caches and the matching attention mask."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.cache = None  # DynamicCache with batch dimension len(jobs)
        self.mask: torch.Tensor | None = None  # (batch, cached length), 1 = real token
        self.last: list[int] = []  # the newest token of each job, not yet in the cache

    def add(self, jobs: list[Job], cache, mask: torch.Tensor, first_tokens: list[int]) -> None:
        """Append ``jobs`` (prefilled together: ``cache`` and ``mask`` have one row per job)."""
        layers = _kv(cache)
        length = layers[0][0].shape[-2]
        if not self.jobs:
            self.cache, self.mask = cache, mask
        else:
            mine = self.mask.shape[1]
            width = max(mine, length)
            merged = [(torch.cat([_pad_left(k0, width), _pad_left(k1, width)]),
                       torch.cat([_pad_left(v0, width), _pad_left(v1, width)]))
                      for (k0, v0), (k1, v1) in zip(_kv(self.cache), layers)]
            self.cache = _make_cache(merged)
            self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.jobs.extend(jobs)
        self.last.extend(first_tokens)

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.__init__()
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0])  # columns that are padding in every row go
        self.mask = mask[:, start:]
        self.cache = _make_cache([(k.index_select(0, index)[..., start:, :], v.index_select(0, index)[..., start:, :])
                                  for k, v in _kv(self.cache)])
        self.jobs = [self.jobs[r] for r in rows]
        self.last = [self.last[r] for r in rows]


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (-2 for K/V, -1 for a mask) on the left to ``width``."""
    dim = -1 if t.dim() == 2 else -2
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _sample(logits: torch.Tensor, limits: GenerationLimits) -> int:
    """Greedy at temperature below :data:`MIN_TEMPERATURE`, else nucleus sampling (``top_p``) at
    ``temperature``. The most likely token is always kept, however small ``top_p`` is. Raises
    ValueError when the distribution cannot be sampled (the request fails; the batch goes on)."""
    if not limits.temperature >= MIN_TEMPERATURE:
        if limits.temperature != limits.temperature:
            raise ValueError("temperature is NaN")
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / limits.temperature, dim=-1)
    if limits.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        drop = before >= limits.top_p  # keep the smallest set reaching top_p ...
        drop[0] = False  # ... and never less than the most likely token (top_p may round to 0 in float32)
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise ValueError(f"cannot sample at temperature {limits.temperature!r} and top_p {limits.top_p!r}: "
                         "the probabilities are not finite")
    return int(torch.multinomial(probs, 1))


class BatchedGenerator:
    """Generate many requests together on one model; see the module docstring."""

    def __init__(self, chat: ChatModel, *, max_batch_size: int = 8) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.chat = chat
        self.max_batch_size = max_batch_size
        self._waiting: collections.deque[Job] = collections.deque()
        self._batch = _Batch()
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0  # decoding steps run (a step serves every job in the batch)
        self.prefill_passes = 0  # forward passes over prompts (one serves every job joining at a boundary)
        self.largest_batch = 0
        self._thread = threading.Thread(target=self._loop, name="shardwise-generate", daemon=True)
        self._thread.start()

    # ---- API ------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], limits: GenerationLimits, *,
               on_text: Callable[[str], None] | None = None, timeout: float | None = None) -> Job:
        job = Job(list(prompt_ids), limits, on_text=on_text, timeout=timeout)
        with self._wake:
            if self._closed:
                raise RuntimeError("the generator is closed")
            self._waiting.append(job)
            self._wake.notify()
        return job

    @property
    def running(self) -> int:
        return len(self._batch.jobs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- the generation thread ----------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._batch.jobs:
                    self._wake.wait()
                if self._closed:
                    break
                joining = []
                while self._waiting and len(self._batch.jobs) + len(joining) < self.max_batch_size:
                    joining.append(self._waiting.popleft())
            self._prefill_all(joining)
            self._expire_waiting()
            if not self._batch.jobs:
                continue
            try:
                self._step()
            except Exception as exc:  # the batched forward pass itself failed: every request in it fails
                logger.exception("generation step failed")
                for job in self._batch.jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                self._batch = _Batch()
        for job in [*self._waiting, *self._batch.jobs]:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        with self._wake:
            for job in list(self._waiting):
                if job.cancelled.is_set() or (job.deadline is not None and now > job.deadline):
                    self._waiting.remove(job)
                    self._finish(job, "cancelled" if job.cancelled.is_set() else "timeout")

    def _prefill_all(self, joining: list[Job]) -> None:
        """Prefill the joining jobs in one forward pass (one pass per job costs nearly a whole
        decoding step each on a CPU, and the running batch waits for all of them). If that pass
        fails, each job is prefilled alone, so a bad prompt fails only its own request."""
        jobs = []
        for job in joining:
            if job.cancelled.is_set():
                self._finish(job, "cancelled")
            else:
                jobs.append(job)
        if not jobs:
            return
        try:
            out, mask = self._forward_prompts(jobs)
        except Exception as exc:
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
                return
            for job in jobs:
                try:
                    out, mask = self._forward_prompts([job])
                except Exception as exc:  # this request's prompt: it fails alone
                    self._fail(job, exc)
                else:
                    self._join([job], out, mask)
            return
        self._join(jobs, out, mask)

    @torch.no_grad()
    def _forward_prompts(self, jobs: list[Job]):
        """One forward pass over the prompts of ``jobs``, left-padded to the longest."""
        from transformers import DynamicCache

        device = self.chat.device
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.chat.pad_id or 0, dtype=torch.long, device=device)
        mask = torch.zeros((len(jobs), width), dtype=torch.long, device=device)
        for row, job in enumerate(jobs):
            ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids, dtype=torch.long)
            mask[row, width - len(job.prompt_ids):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self.prefill_passes += 1
        out = self.chat.model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(),
                              position_ids=positions, use_cache=True)
        return out, mask

    def _join(self, jobs: list[Job], out, mask: torch.Tensor) -> None:
        """Sample each prefilled job's first token; those not finished by it join the batch."""
        keep, first = [], []
        for row, job in enumerate(jobs):
            try:
                token = _sample(out.logits[row, -1], job.limits)
                if job.on_text is not None:
                    job._deltas = _TextDeltas(self.chat.tokenizer, job.on_text)
                    job._deltas._prompt_seen = True
                finished = self._emit(job, token)
            except Exception as exc:  # this request's sampling settings: it fails alone
                self._fail(job, exc)
                continue
            if not finished:
                keep.append(row)
                first.append(token)
        if not keep:
            return
        index = torch.tensor(keep, device=mask.device)
        cache = _make_cache([(k.index_select(0, index), v.index_select(0, index))
                             for k, v in _kv(out.past_key_values)])
        self._batch.add([jobs[r] for r in keep], cache, mask.index_select(0, index), first)

    @torch.no_grad()
    def _step(self) -> None:
        batch = self._batch
        device = batch.mask.device
        positions = batch.mask.sum(1, keepdim=True)  # real tokens so far = the new token's position
        mask = torch.cat([batch.mask, torch.ones(len(batch.jobs), 1, dtype=batch.mask.dtype, device=device)], 1)
        ids = torch.tensor(batch.last, dtype=torch.long, device=device)[:, None]
        out = self.chat.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                              past_key_values=batch.cache, use_cache=True)
        batch.cache, batch.mask = out.past_key_values, mask
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(batch.jobs))
        keep = []
        for row, job in enumerate(batch.jobs):
            try:
                token = _sample(out.logits[row, -1], job.limits)
                finished = self._emit(job, token)
            except Exception as exc:  # one request's sampling or decoding: it leaves, the others go on
                self._fail(job, exc)
                continue
            if not finished:
                keep.append(row)
                batch.last[row] = token
        if len(keep) < len(batch.jobs):
            batch.keep(keep)

    def _fail(self, job: Job, exc: Exception) -> None:
        logger.warning("request failed alone (%d tokens generated): %s: %s", len(job.tokens), type(exc).__name__, exc)
        if not job.future.done():
            job.future.set_exception(RequestFailed(f"generation failed for this request: {exc}"))

    def _emit(self, job: Job, token: int) -> bool:
        """Record ``token`` for ``job``; True when the job is finished (and its future resolved)."""
        eos = self.chat.tokenizer.eos_token_id
        job.tokens.append(token)
        if job._deltas is not None:
            job._deltas.put(torch.tensor([token]))
        if token == eos:
            return self._finish(job, "stop")
        if len(job.tokens) >= job.limits.max_new_tokens:
            return self._finish(job, "length")
        if job.cancelled.is_set():
            return self._finish(job, "cancelled")
        if job.deadline is not None and time.monotonic() > job.deadline:
            return self._finish(job, "timeout")
        return False

    def _finish(self, job: Job, reason: str) -> bool:
        text = self.chat.tokenizer.decode(job.tokens, skip_special_tokens=True)
        if job._deltas is not None:
            job._deltas.finish(text)
        answer = Answer(text=text, prompt_tokens=len(job.prompt_ids), completion_tokens=len(job.tokens),
                        finish_reason=reason)
        if reason == "timeout":
            job.future.set_exception(GenerationTimeout(job.timeout or 0.0, answer))
        else:
            job.future.set_result(answer)
        return True
