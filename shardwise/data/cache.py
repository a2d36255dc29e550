"""Tokenise a chat data set once into memory-mapped token files, and reuse them.

Layout of one cache entry, ``<cache_dir>/<key>/``::

    index.json            what the entry was built from, sample counts per piece, skipped records
    p00000.tokens.bin     token ids of every sample of piece 0, back to back (uint16 or uint32)
    p00000.offsets.bin    int64, count+1 entries: sample i is tokens[offsets[i]:offsets[i+1]]
    p00000.source.bin     int32, count entries: how many leading tokens of sample i are prompt

The key hashes the data files' contents, the tokenizer, the template, the length limits and
the column names, so any change builds a new entry and an unchanged setup reuses the old one.

Building is split into pieces (byte ranges of JSON-lines files); with W processes and
``workers`` tokenising processes each, there are W*workers pieces, each written by one of them.
An entry is assembled in a temporary folder and renamed into place when complete, so a crash
never leaves a half-written entry behind that a later run would trust.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from shardwise import comm
from shardwise.checkpoint.files import sha256
from shardwise.data.chat import ChatEncoder
from shardwise.data.records import MAX_RECORD_BYTES, BadRecord, Columns, read_records

logger = logging.getLogger("shardwise")

FORMAT_VERSION = 2  # 2: duplicate keys and over-long records are refused
_BATCH = 512  # samples tokenised per tokenizer call
_SHOWN_BAD = 5  # skipped records named in the log and index

__all__ = ["CacheInfo", "build_or_load_cache", "cache_key"]


@dataclass
class CacheInfo:
    path: str
    reused: bool
    num_samples: int
    skipped: int
    bad_examples: list[str] = field(default_factory=list)


def cache_key(files: Sequence[str], encoder: ChatEncoder, columns: Columns, skip_bad_lines: bool,
              max_record_bytes: int = MAX_RECORD_BYTES) -> tuple[str, dict]:
    """``(key, what it was computed from)``; the key names the cache entry."""
    fields = {
        "version": FORMAT_VERSION,
        "files": [{"name": os.path.basename(f), "sha256": sha256(f)} for f in files],
        "columns": [columns.prompt, columns.response, columns.history],
        "skip_bad_lines": skip_bad_lines,
        "max_record_bytes": max_record_bytes,
        **encoder.describe(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return key, fields


def _same_on_all_ranks(value: Any) -> Any:
    """Rank 0's value, on every rank (no-op without a process group)."""
    if comm.get_world_size() == 1:
        return value
    return comm.broadcast_object(value, src=0)


def build_or_load_cache(files: Sequence[str], encoder: ChatEncoder, cache_dir: str, *, columns: Columns,
                        skip_bad_lines: bool = False, workers: int = 1,
                        max_record_bytes: int = MAX_RECORD_BYTES) -> CacheInfo:
    """Return the cache entry for ``files``, building it first if needed.

    Call it on every rank of the job (it uses barriers); the cache folder must be visible to all
    of them. Rank 0 hashes the inputs; each rank tokenises only its own pieces. A bad record
    raises ValueError (the same message on every rank) unless ``skip_bad_lines``.
    """
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"data file not found: {f}")
    rank, world = comm.get_rank(), comm.get_world_size()
    key, fields = cache_key(files, encoder, columns, skip_bad_lines, max_record_bytes) if rank == 0 else (None, None)
    key, fields, nonce = _same_on_all_ranks((key, fields, uuid.uuid4().hex[:8]))
    final = os.path.join(cache_dir, key)
    if _same_on_all_ranks(os.path.isfile(os.path.join(final, "index.json"))):
        return _info(final, reused=True)

    tmp = os.path.join(cache_dir, f".tmp-{key}-{nonce}")
    if rank == 0:
        os.makedirs(tmp, exist_ok=True)
    comm.barrier()
    plan = [(f, p, world * workers) for f in files for p in range(world * workers)]
    mine = [i for i in range(len(plan)) if (i // workers) % world == rank]
    jobs = [(i, *plan[i], tmp, encoder, columns, skip_bad_lines, max_record_bytes) for i in mine]
    if workers > 1 and _can_have_children():
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            pool.starmap(_build_piece, jobs)
    else:
        for job in jobs:
            _build_piece(*job)
    comm.barrier()
    pieces = []
    for i in range(len(plan)):
        with open(os.path.join(tmp, f"p{i:05d}.json")) as f:
            pieces.append(json.load(f))
    comm.barrier()  # every rank has read the reports before rank 0 moves or removes the folder
    errors = [p["error"] for p in pieces if p.get("error")]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(errors[0])
    if rank == 0:
        _publish(tmp, final, fields, pieces, encoder)
    comm.barrier()
    info = _info(final, reused=False)
    if rank == 0 and info.skipped:
        logger.warning("skipped %d bad record(s) in %s, e.g. %s", info.skipped, ", ".join(files),
                       "; ".join(info.bad_examples))
    return info


def _can_have_children() -> bool:
    import multiprocessing as mp

    if mp.current_process().daemon:  # e.g. a multiprocessing-spawned worker: it may not start a pool
        logger.warning("this process is daemonic and cannot start tokenising workers; tokenising its "
                       "pieces one after another")
        return False
    return True


def _build_piece(index: int, path: str, part: int, parts: int, tmp: str, encoder: ChatEncoder,
                 columns: Columns, skip_bad_lines: bool, max_record_bytes: int) -> None:
    """Tokenise one piece into its three .bin files and a small JSON report."""
    stem = os.path.join(tmp, f"p{index:05d}")
    dtype = _token_dtype(encoder)
    report: dict[str, Any] = {"count": 0, "tokens": 0, "skipped": 0, "bad": [], "error": None}
    offsets_end = 0
    with open(stem + ".tokens.bin", "wb") as ftok, open(stem + ".offsets.bin", "wb") as foff, \
            open(stem + ".source.bin", "wb") as fsrc:
        foff.write(np.zeros(1, dtype=np.int64).tobytes())
        batch: list[tuple[list, str]] = []

        def flush() -> None:
            nonlocal offsets_end
            encoded = encoder.encode_batch(batch)
            lengths = np.array([len(e.input_ids) for e in encoded], dtype=np.int64)
            flat = [t for e in encoded for t in e.input_ids]
            ftok.write(np.asarray(flat, dtype=dtype).tobytes())
            foff.write((offsets_end + np.cumsum(lengths)).tobytes())
            fsrc.write(np.array([e.source_length for e in encoded], dtype=np.int32).tobytes())
            offsets_end += int(lengths.sum())
            report["count"] += len(encoded)
            batch.clear()

        try:
            for item in read_records(path, columns, part=part, parts=parts, max_record_bytes=max_record_bytes):
                if isinstance(item, BadRecord):
                    if not skip_bad_lines:
                        raise item
                    report["skipped"] += 1
                    if len(report["bad"]) < _SHOWN_BAD:
                        report["bad"].append(str(item))
                    continue
                _, messages, response = item
                batch.append((messages, response))
                if len(batch) >= _BATCH:
                    flush()
            if batch:
                flush()
        except BadRecord as exc:
            report["error"] = str(exc) + (" (use --skip_bad_lines to skip bad records)"
                                          if exc.skippable and not skip_bad_lines else "")
    report["tokens"] = offsets_end
    with open(stem + ".json", "w") as f:
        json.dump(report, f)


def _token_dtype(encoder: ChatEncoder):
    return np.uint16 if len(encoder.tokenizer) <= np.iinfo(np.uint16).max else np.uint32


def _publish(tmp: str, final: str, fields: dict, pieces: list[dict], encoder: ChatEncoder) -> None:
    skipped = sum(p["skipped"] for p in pieces)
    bad = [b for p in pieces for b in p["bad"]][:_SHOWN_BAD]
    index = {
        "built_from": fields,
        "token_dtype": np.dtype(_token_dtype(encoder)).name,
        "num_samples": sum(p["count"] for p in pieces),
        "num_tokens": sum(p["tokens"] for p in pieces),
        "skipped": skipped,
        "bad_examples": bad,
        "pieces": [{"stem": f"p{i:05d}", "count": p["count"], "tokens": p["tokens"]} for i, p in enumerate(pieces)],
    }
    with open(os.path.join(tmp, "index.json"), "w") as f:
        json.dump(index, f, indent=1, ensure_ascii=False)
    for i in range(len(pieces)):
        os.remove(os.path.join(tmp, f"p{i:05d}.json"))
    try:
        os.rename(tmp, final)
    except OSError:  # another job published the same entry first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _info(path: str, *, reused: bool) -> CacheInfo:
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    return CacheInfo(path=path, reused=reused, num_samples=index["num_samples"], skipped=index["skipped"],
                     bad_examples=index["bad_examples"])
