"""Batched decoding for the chat server: concurrent requests are generated together.

One thread owns the model and runs steps. At each step boundary the requests that are waiting
(up to the free places, and while the KV cache has room for them) are *prefilled* together in
one forward pass; they then join the running batch, and a decoding step is one forward pass for
every active request. A request leaves the batch when it reaches EOS, a stop string, its token
limit, its deadline (``timeout``) or is cancelled (the client went away); the others go on.

The KV cache (``kv_cache="paged"``, the default) is the paged, prefix-cached one of
:mod:`shardwise.apps.kv_cache`: blocks of ``kv_block_size`` tokens within a ``kv_cache_bytes``
budget, a request waiting (not failing) while its blocks are not free, and the blocks of a
prompt prefix that an earlier request computed reused. ``kv_cache="padded"`` keeps the earlier
layout: each request's cache left-padded to the longest and stacked.

LoRA adapters (``adapters={name: folder}``) are applied per request over the one base model
(:mod:`shardwise.apps.adapters`): requests for different adapters and for the base share a batch.

One request's failure is its own: a prompt the model cannot take (the joint prefill is then
retried one request at a time), sampling settings that cannot be computed, or a streaming
consumer that raises fail that request with :class:`RequestFailed`; only an error in the
batched decoding step itself fails the requests in it.

    engine = BatchedGenerator(chat, max_batch_size=8, adapters={"sql": "out/sql-lora"})
    job = engine.submit(prompt_ids, limits, on_text=print, timeout=60, adapter="sql", logprobs=2)
    answer = job.result()            # or await asyncio.wrap_future(job.future)
    scored = engine.score(prompt_ids, top=2).result()   # logprob of each prompt token

``max_batch_size`` 1 gives one-at-a-time generation (the benchmark's reference).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardwise.apps.adapters import BASE, LoraAdapters
from shardwise.apps.generation import MIN_TEMPERATURE, Answer, ChatModel, GenerationLimits, TokenLogprob
from shardwise.apps.kv_cache import PagedCache, PagedKV, default_cache_bytes, kv_bytes_per_token, model_kv_shape, \
    paged_attention_of

__all__ = ["BatchedGenerator", "Job", "ScoreJob", "GenerationTimeout", "MIN_TEMPERATURE", "RequestFailed",
           "RequestTooLarge"]

logger = logging.getLogger("shardwise")

KV_CACHES = ("paged", "padded")


class RequestFailed(RuntimeError):
    """One request could not be generated (its own prompt or sampling settings); the others went on."""


class RequestTooLarge(ValueError):
    """The request could never fit the KV cache (its prompt plus its token limit needs more blocks than
    ``kv_cache_bytes`` holds): refused at submission rather than queued for ever."""


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
    adapter: str | None = None
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and the k most likely
    seed: int | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None  # monotonic time the first token was sampled
    cached_tokens: int = 0
    _adapter_index: int = BASE
    _generator: torch.Generator | None = None
    _counts: torch.Tensor | None = None  # how often each token was generated (penalties)
    _logprobs: list[TokenLogprob] = field(default_factory=list)
    _sent: str = ""  # streamed text so far
    _text: str | None = None  # the answer cut at a stop string
    _seq: object = None  # the job's place in the paged KV cache

    def cancel(self) -> None:
        """Stop generating at the next step boundary (the answer so far ends as "cancelled")."""
        self.cancelled.set()

    def result(self, timeout: float | None = None) -> Answer:
        return self.future.result(timeout)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout


@dataclass
class ScoreJob:
    """Log-probabilities of a prompt's own tokens (``result()``: one :class:`TokenLogprob` per
    token, the first with logprob None)."""
    prompt_ids: list[int]
    top: int = 0
    adapter: str | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    _adapter_index: int = BASE

    def result(self, timeout: float | None = None) -> list[TokenLogprob]:
        return self.future.result(timeout)


def _sample(logits: torch.Tensor, limits: GenerationLimits, generator: torch.Generator | None = None,
            counts: torch.Tensor | None = None) -> int:
    """Greedy at temperature below :data:`MIN_TEMPERATURE`, else nucleus sampling (``top_p``) at
    ``temperature``, after the presence/frequency penalties (``counts``: each token's count so far).
    The most likely token is always kept, however small ``top_p`` is. Raises ValueError when the
    distribution cannot be sampled (the request fails; the batch goes on)."""
    if counts is not None:
        logits = logits.float() - limits.frequency_penalty * counts - limits.presence_penalty * (counts > 0).float()
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
    return int(torch.multinomial(probs, 1, generator=generator))


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))


def _holdback(text: str, stops) -> int:
    """How many characters at the end of ``text`` could begin a stop string (not streamed yet)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# ------------------------------------------------------------------ the two KV cache layouts

class _PaddedBackend:
    """Left-padded caches stacked into one batch (a DynamicCache), as the engine first had."""

    def __init__(self, engine: "BatchedGenerator") -> None:
        self.engine = engine
        self.model = engine.chat.model
        self.cache_kwarg = _cache_kwarg(self.model)
        self.jobs: list[Job] = []
        self.cache = None
        self.mask: torch.Tensor | None = None
        self.layers, self.kv_heads, self.head_dim = model_kv_shape(self.model.config)
        self.bytes_per_token = kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim,
                                                  next(self.model.parameters()).dtype)

    def fits(self, job: Job) -> bool:
        return True

    def admit(self, job: Job) -> bool:
        return True

    def release(self, job: Job) -> None:
        pass

    def _adapters(self, jobs: list[Job]) -> torch.Tensor:
        return torch.tensor([[j._adapter_index] for j in jobs], device=self.engine.chat.device)

    @torch.no_grad()
    def prefill(self, jobs: list[Job]) -> torch.Tensor:
        from transformers import DynamicCache

        chat = self.engine.chat
        device = chat.device
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), chat.pad_id or 0, dtype=torch.long, device=device)
        mask = torch.zeros((len(jobs), width), dtype=torch.long, device=device)
        for row, job in enumerate(jobs):
            ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids, dtype=torch.long)
            mask[row, width - len(job.prompt_ids):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with self.engine._use_adapters(self._adapters(jobs)):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{self.cache_kwarg: DynamicCache()})
        self._add(jobs, _out_cache(out), mask)
        return out.logits[:, -1]

    def _add(self, jobs: list[Job], cache, mask: torch.Tensor) -> None:
        layers = _kv(cache)
        length = layers[0][0].shape[-2]
        if not self.jobs:
            self.cache, self.mask = cache, mask
        else:
            width = max(self.mask.shape[1], length)
            merged = [(torch.cat([_pad_left(k0, width), _pad_left(k1, width)]),
                       torch.cat([_pad_left(v0, width), _pad_left(v1, width)]))
                      for (k0, v0), (k1, v1) in zip(_kv(self.cache), layers)]
            self.cache = _make_cache(merged)
            self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.jobs.extend(jobs)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        device = self.mask.device
        positions = self.mask.sum(1, keepdim=True)  # real tokens so far = the new token's position
        mask = torch.cat([self.mask, torch.ones(len(self.jobs), 1, dtype=self.mask.dtype, device=device)], 1)
        ids = torch.tensor([j.tokens[-1] for j in self.jobs], dtype=torch.long, device=device)[:, None]
        with self.engine._use_adapters(self._adapters(self.jobs)):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self.cache_kwarg: self.cache})
        self.cache, self.mask = _out_cache(out), mask
        return out.logits[:, -1]

    def drop(self, gone: list[Job]) -> None:
        if not gone:
            return
        rows = [r for r, j in enumerate(self.jobs) if not any(j is g for g in gone)]
        if not rows:
            self.jobs, self.cache, self.mask = [], None, None
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0])  # columns that are padding in every row go
        self.mask = mask[:, start:]
        self.cache = _make_cache([(k.index_select(0, index)[..., start:, :], v.index_select(0, index)[..., start:, :])
                                  for k, v in _kv(self.cache)])
        self.jobs = [self.jobs[r] for r in rows]

    def stats(self) -> dict:
        width = 0 if self.mask is None else self.mask.shape[1]
        active = 0 if self.mask is None else int(self.mask.sum())
        held = len(self.jobs) * width
        return {"layout": "padded", "blocks_total": None, "blocks_used": None, "block_size": None,
                "bytes_per_token": self.bytes_per_token, "bytes_total": None, "bytes_used": held * self.bytes_per_token,
                "active_tokens": active, "active_sequences": len(self.jobs), "prefix_hits": 0, "prefix_lookups": 0}


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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


class _PagedBackend:
    """The paged, prefix-cached KV cache; every forward pass packs the sequences' new tokens in one row."""

    def __init__(self, engine: "BatchedGenerator", max_bytes: int, block_size: int) -> None:
        self.engine = engine
        self.model = engine.chat.model
        self.kv = PagedKV(self.model, max_bytes=max_bytes, block_size=block_size)
        self.cache_kwarg = _cache_kwarg(self.model)
        self.jobs: list[Job] = []

    def fits(self, job: Job) -> bool:
        tokens = len(job.prompt_ids) + job.limits.max_new_tokens - 1
        return self.kv.blocks_for(tokens) <= self.kv.pool.num_blocks

    def admit(self, job: Job) -> bool:
        seq = self.kv.admit(job.prompt_ids, job.limits.max_new_tokens, job._adapter_index)
        if seq is None:
            return False
        job._seq, job.cached_tokens = seq, seq.cached
        return True

    def release(self, job: Job) -> None:
        if job._seq is not None:
            self.kv.release(job._seq)
            job._seq = None

    @torch.no_grad()
    def _forward(self, jobs: list[Job], new: list[list[int]]) -> torch.Tensor:
        device = self.engine.chat.device
        seqs = [j._seq for j in jobs]
        starts = [len(s.tokens) for s in seqs]
        plan = self.kv.plan(seqs, new)
        lengths = torch.tensor([len(t) for t in new], device=device)
        ids = torch.tensor([t for tokens in new for t in tokens], dtype=torch.long, device=device)[None]
        positions = torch.cat([torch.arange(s, s + len(t), device=device) for s, t in zip(starts, new)])[None]
        adapters = torch.tensor([j._adapter_index for j in jobs], device=device).repeat_interleave(lengths)[None]
        with paged_attention_of(self.model), self.engine._use_adapters(adapters):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                             logits_to_keep=lengths.cumsum(0) - 1, shardwise_paged=plan,
                             **{self.cache_kwarg: PagedCache(plan)})
        for seq in seqs:
            self.kv.commit(seq)
        return out.logits[0]

    def prefill(self, jobs: list[Job]) -> torch.Tensor:
        logits = self._forward(jobs, [j.prompt_ids[len(j._seq.tokens):] for j in jobs])
        self.jobs.extend(jobs)
        return logits

    def step(self) -> torch.Tensor:
        return self._forward(self.jobs, [[j.tokens[-1]] for j in self.jobs])

    def drop(self, gone: list[Job]) -> None:
        for job in gone:
            self.release(job)
        ids = {id(j) for j in gone}
        self.jobs = [j for j in self.jobs if id(j) not in ids]

    def stats(self) -> dict:
        return {"layout": "paged", **self.kv.stats()}


# ------------------------------------------------------------------ the engine

class BatchedGenerator:
    """Generate many requests together on one model; see the module docstring.

    ``kv_cache_bytes`` bounds the paged cache (default: room for ``max_batch_size`` sequences of the
    model's whole context); ``kv_block_size`` is its block size in tokens.
    """

    def __init__(self, chat: ChatModel, *, max_batch_size: int = 8, adapters: dict[str, str] | None = None,
                 kv_cache: str = "paged", kv_cache_bytes: int | None = None, kv_block_size: int = 16) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {kv_cache_bytes}")
        self.chat = chat
        self.max_batch_size = max_batch_size
        self._lora = LoraAdapters(chat.model, adapters) if adapters else None
        self.vocab_size = int(chat.model.get_input_embeddings().num_embeddings)
        if kv_cache == "paged":
            budget = kv_cache_bytes or default_cache_bytes(chat.model, max_batch_size, chat.context_length)
            self._backend = _PagedBackend(self, budget, kv_block_size)
        else:
            self._backend = _PaddedBackend(self)
        self.kv_cache = kv_cache
        self._waiting: collections.deque[Job] = collections.deque()
        self._scoring: collections.deque[ScoreJob] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0  # decoding steps run (a step serves every job in the batch)
        self.prefill_passes = 0  # forward passes over prompts (one serves every job joining at a boundary)
        self.largest_batch = 0
        self._thread = threading.Thread(target=self._loop, name="shardwise-generate", daemon=True)
        self._thread.start()

    # ---- API ------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters (requests pick one by name; None is the base model)."""
        return list(self._lora.names) if self._lora is not None else []

    def _adapter_index(self, adapter: str | None) -> int:
        if adapter is None:
            return BASE
        if self._lora is None:
            raise ValueError(f"unknown adapter {adapter!r} (loaded: none)")
        return self._lora.index(adapter)

    def submit(self, prompt_ids: list[int], limits: GenerationLimits, *,
               on_text: Callable[[str], None] | None = None, timeout: float | None = None,
               adapter: str | None = None, logprobs: int | None = None, seed: int | None = None) -> Job:
        """Queue a request; ``seed`` (or ``limits.seed``) gives it a sampling generator of its own.
        ValueError for an unknown adapter or a negative ``logprobs``; :class:`RequestTooLarge` when
        it could never fit the KV cache."""
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be 0 or more, got {logprobs}")
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if isinstance(limits.stop, str):  # OpenAI's API takes one stop string or a list
            limits = dataclasses.replace(limits, stop=(limits.stop,))
        seed = limits.seed if seed is None else seed
        job = Job(list(prompt_ids), limits, on_text=on_text, timeout=timeout, adapter=adapter, logprobs=logprobs,
                  seed=seed)
        job._adapter_index = self._adapter_index(adapter)
        if seed is not None:
            job._generator = torch.Generator(device=self.chat.device).manual_seed(int(seed))
        if not self._backend.fits(job):
            kv = self._backend.kv
            raise RequestTooLarge(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                                  f"({limits.max_new_tokens}) needs more KV cache than the server has "
                                  f"({kv.capacity_tokens} tokens in {kv.pool.num_blocks} blocks of {kv.block_size}; "
                                  "--kv_cache_bytes)")
        with self._wake:
            if self._closed:
                raise RuntimeError("the generator is closed")
            self._waiting.append(job)
            self._wake.notify()
        return job

    def score(self, prompt_ids: list[int], *, adapter: str | None = None, top: int = 0) -> ScoreJob:
        """Queue the scoring of ``prompt_ids``: the logprob of each token given the ones before it
        (the first token's is None) and the ``top`` most likely tokens at each place; runs in the
        generation thread between steps."""
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if top < 0:
            raise ValueError(f"top must be 0 or more, got {top}")
        job = ScoreJob(list(prompt_ids), top=top, adapter=adapter)
        job._adapter_index = self._adapter_index(adapter)
        with self._wake:
            if self._closed:
                raise RuntimeError("the generator is closed")
            self._scoring.append(job)
            self._wake.notify()
        return job

    def kv_cache_stats(self) -> dict:
        """The KV cache's use: blocks_total/used/cached/free, block_size, bytes_per_token, bytes_total/used,
        active_tokens/sequences, prefix_hits/lookups (blocks), evictions. ``padded``: bytes held by the
        stacked caches, padding included."""
        return self._backend.stats()

    @property
    def _batch(self):
        """The running batch (``.jobs``, in row order)."""
        return self._backend

    @property
    def running(self) -> int:
        return len(self._backend.jobs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
        if self._lora is not None:
            self._lora.remove()  # the base model is as it was loaded

    def _use_adapters(self, token_adapters: torch.Tensor):
        import contextlib

        return self._lora.use(token_adapters) if self._lora is not None else contextlib.nullcontext()

    # ---- the generation thread ----------------------------------------------------
    def _loop(self) -> None:
        backend = self._backend
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._scoring and not backend.jobs:
                    self._wake.wait()
                if self._closed:
                    break
                scoring = list(self._scoring)
                self._scoring.clear()
                joining = self._admit()
            for job in scoring:
                self._score(job)
            self._prefill_all(joining)
            self._expire_waiting()
            if not backend.jobs:
                if self._waiting and not joining and not scoring:
                    time.sleep(0.001)  # nothing admissible now (cancelled jobs are collected above)
                continue
            try:
                logits = backend.step()
            except Exception as exc:  # the batched forward pass itself failed: every request in it fails
                logger.exception("generation step failed")
                for job in backend.jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                backend.drop(list(backend.jobs))
                continue
            self.steps += 1
            self.largest_batch = max(self.largest_batch, len(backend.jobs))
            gone = []
            for row, job in enumerate(backend.jobs):
                try:
                    finished = self._next(job, logits[row])
                except Exception as exc:  # one request's sampling or decoding: it leaves, the others go on
                    self._fail(job, exc)
                    finished = True
                if finished:
                    gone.append(job)
            backend.drop(gone)
        for job in [*self._waiting, *backend.jobs, *self._scoring]:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))

    def _admit(self) -> list[Job]:
        """Waiting jobs that join now, in order, while places and KV blocks last (called under the lock)."""
        joining: list[Job] = []
        while self._waiting and len(self._backend.jobs) + len(joining) < self.max_batch_size:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                self._finish(job, "cancelled")
                continue
            bad = next((t for t in job.prompt_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                self._waiting.popleft()
                self._fail(job, ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"))
                continue
            if not self._backend.admit(job):
                break  # the KV cache is full: the job waits for blocks to come free
            joining.append(self._waiting.popleft())
        return joining

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        with self._wake:
            for job in list(self._waiting):
                if job.cancelled.is_set() or (job.deadline is not None and now > job.deadline):
                    self._waiting.remove(job)
                    self._finish(job, "cancelled" if job.cancelled.is_set() else "timeout")

    def _prefill_all(self, jobs: list[Job]) -> None:
        """Prefill the joining jobs in one forward pass (one pass per job costs nearly a whole
        decoding step each on a CPU, and the running batch waits for all of them). If that pass
        fails, each job is prefilled alone, so a bad prompt fails only its own request."""
        if not jobs:
            return
        backend = self._backend
        try:
            self.prefill_passes += 1
            logits = backend.prefill(jobs)
        except Exception as exc:
            for job in jobs:
                backend.release(job)
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
                return
            for job in jobs:
                if not backend.admit(job):  # cannot happen: the blocks were just given back
                    self._fail(job, RuntimeError("no room in the KV cache to retry the prompt alone"))
                    continue
                try:
                    self.prefill_passes += 1
                    logits = backend.prefill([job])
                except Exception as exc:  # this request's prompt: it fails alone
                    backend.release(job)
                    self._fail(job, exc)
                else:
                    self._join([job], logits)
            return
        self._join(jobs, logits)

    def _join(self, jobs: list[Job], logits: torch.Tensor) -> None:
        """Sample each prefilled job's first token; those finished by it leave at once."""
        gone = []
        now = time.monotonic()
        for row, job in enumerate(jobs):
            job.first_token_at = now
            try:
                if self._next(job, logits[row]):
                    gone.append(job)
            except Exception as exc:  # this request's sampling settings: it fails alone
                self._fail(job, exc)
                gone.append(job)
        self._backend.drop(gone)

    def _next(self, job: Job, logits: torch.Tensor) -> bool:
        """Sample ``job``'s next token from its ``logits``; True when the job is finished."""
        limits = job.limits
        counts = None
        if limits.presence_penalty or limits.frequency_penalty:
            if job._counts is None:
                job._counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            counts = job._counts
        token = _sample(logits, limits, job._generator, counts)
        if counts is not None:
            counts[token] += 1
        if job.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            job._logprobs.append(TokenLogprob(token, float(lp[token]), _top(lp, job.logprobs)))
        return self._emit(job, token)

    def _fail(self, job, exc: Exception) -> None:
        tokens = len(getattr(job, "tokens", []))
        logger.warning("request failed alone (%d tokens generated): %s: %s", tokens, type(exc).__name__, exc)
        if not job.future.done():
            job.future.set_exception(RequestFailed(f"generation failed for this request: {exc}"))

    def _emit(self, job: Job, token: int) -> bool:
        """Record ``token`` for ``job``; True when the job is finished (and its future resolved)."""
        eos = self.chat.tokenizer.eos_token_id
        job.tokens.append(token)
        if token == eos:
            return self._finish(job, "stop")
        stops = [s for s in job.limits.stop if s]
        if stops or job.on_text is not None:
            text = self.chat.tokenizer.decode(job.tokens, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                job._text = text[:cut]
                return self._finish(job, "stop")
            if job.on_text is not None:
                visible = text[:len(text) - _holdback(text, stops)]
                if not visible.endswith("\ufffd") and visible.startswith(job._sent) and len(visible) > len(job._sent):
                    piece, job._sent = visible[len(job._sent):], visible
                    job.on_text(piece)
        if len(job.tokens) >= job.limits.max_new_tokens:
            return self._finish(job, "length")
        if job.cancelled.is_set():
            return self._finish(job, "cancelled")
        if job.deadline is not None and time.monotonic() > job.deadline:
            return self._finish(job, "timeout")
        return False

    def _finish(self, job: Job, reason: str) -> bool:
        text = job._text if job._text is not None else self.chat.tokenizer.decode(job.tokens, skip_special_tokens=True)
        if job.on_text is not None and text.startswith(job._sent) and len(text) > len(job._sent):
            piece, job._sent = text[len(job._sent):], text
            try:
                job.on_text(piece)
            except Exception as exc:
                self._fail(job, exc)
                return True
        answer = Answer(text=text, prompt_tokens=len(job.prompt_ids), completion_tokens=len(job.tokens),
                        finish_reason=reason, token_ids=list(job.tokens),
                        logprobs=list(job._logprobs) if job.logprobs is not None else None,
                        cached_tokens=job.cached_tokens)
        if job.future.done():
            return True
        if reason == "timeout":
            job.future.set_exception(GenerationTimeout(job.timeout or 0.0, answer))
        else:
            job.future.set_result(answer)
        return True

    @torch.no_grad()
    def _score(self, job: ScoreJob) -> None:
        try:
            bad = next((t for t in job.prompt_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
            device = self.chat.device
            ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=device)
            with self._use_adapters(torch.tensor([[job._adapter_index]], device=device)):
                logits = self.chat.model(input_ids=ids, use_cache=False).logits[0]
            lp = torch.log_softmax(logits[:-1].float(), dim=-1)
            target = ids[0, 1:]
            chosen = lp.gather(1, target[:, None])[:, 0].tolist()
            result = [TokenLogprob(job.prompt_ids[0], None, [])]
            for i, token in enumerate(job.prompt_ids[1:]):
                result.append(TokenLogprob(token, chosen[i], _top(lp[i], job.top)))
        except Exception as exc:
            self._fail(job, exc)
            return
        job.future.set_result(result)
