"""Clear errors: corrupted, truncated or missing files, a damaged manifest, a model that does not
match (missing / unexpected / mis-shaped names, and ``load_module_strict=False``), a missing tag,
state that cannot be stored without pickle."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from distributed import run_distributed
from models import TinyMLP, base_config, make_data, make_model, mse


class Wider(TinyMLP):
    def __init__(self) -> None:
        super().__init__(hidden=14)


class Extra(TinyMLP):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.ones(4))


class Renamed(TinyMLP):
    def __init__(self) -> None:
        super().__init__()
        self.head = self.out
        del self.out

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))) + self.frozen))


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, FileNotFoundError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _body(rank, world, root):
    import shardwise

    cfg = base_config(zero_optimization={"stage": 1, "reduce_bucket_size": 64})
    ckpt = os.path.join(root, "ckpt")

    def engine(model=None):
        return shardwise.initialize(model=model or make_model(), config=cfg)[0]

    e = engine()
    x, y = make_data(1, 4)
    e.backward(mse(e(x[0]), y[0]))
    e.step()
    e.save_checkpoint(ckpt, tag="t1")
    folder = os.path.join(ckpt, "t1")
    out = {"bad_client": _error(lambda: e.save_checkpoint(ckpt, tag="t2", client_state={"bad": object()}))}
    out["no_latest"] = engine().load_checkpoint(os.path.join(root, "empty"))

    def damaged(name, damage):
        path = os.path.join(folder, name)
        shutil.copy(path, path + ".bak")
        with open(path, "r+b") as f:
            damage(f)
        try:
            return _error(lambda: engine().load_checkpoint(ckpt))
        finally:
            os.replace(path + ".bak", path)

    def flip(f):
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))

    out["flipped"] = damaged("model.safetensors", flip)
    out["truncated"] = damaged("optim_rank0.safetensors", lambda f: f.truncate(100))
    out["manifest"] = damaged("manifest.json", lambda f: f.truncate(50))
    os.rename(os.path.join(folder, "rank0.json"), os.path.join(root, "rank0.json"))
    out["missing_file"] = _error(lambda: engine().load_checkpoint(ckpt))
    os.rename(os.path.join(root, "rank0.json"), os.path.join(folder, "rank0.json"))
    out["missing_tag"] = _error(lambda: engine().load_checkpoint(ckpt, tag="t9"))
    out.update(_edited_manifests(folder, lambda: _error(lambda: engine().load_checkpoint(ckpt))))
    out["wider"] = _error(lambda: engine(Wider()).load_checkpoint(ckpt))
    out["renamed"] = _error(lambda: engine(Renamed()).load_checkpoint(ckpt))
    out["renamed_lenient_shape"] = _error(lambda: engine(Wider()).load_checkpoint(ckpt, load_module_strict=False))
    lenient = engine(Extra())
    lenient.load_checkpoint(ckpt, load_module_strict=False)
    out["lenient"] = {n: p.detach().clone() for n, p in lenient.module.named_parameters()}
    out["saved"] = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    out["ok"] = engine().load_checkpoint(ckpt)[0]
    return out


def _edited_manifests(folder, load):
    """Load after editing manifest.json in ways that must not pass silently."""
    import hashlib
    import json

    path = os.path.join(folder, "manifest.json")
    original = open(path).read()

    def edit(change, *, redigest):
        manifest = json.loads(original)
        change(manifest)
        if redigest:  # as a buggy writer would leave it: self-consistent, yet missing a file
            body = {k: v for k, v in manifest.items() if k != "digest"}
            text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            manifest["digest"] = hashlib.sha256(text.encode()).hexdigest()
        with open(path, "w") as f:
            json.dump(manifest, f)
        try:
            return load()
        finally:
            with open(path, "w") as f:
                f.write(original)

    def shape(m):
        m["tensors"]["model"]["fc1.bias"]["shape"] = [14]

    def unlist(m):
        del m["files"]["rank0.json"], m["sizes"]["rank0.json"]

    return {"edited_shape": edit(shape, redigest=False), "unlisted": edit(unlist, redigest=False),
            "unlisted_redigested": edit(unlist, redigest=True),
            "no_digest": edit(lambda m: m.pop("digest", None), redigest=False)}


def test_errors_name_the_problem(tmp_path):
    (r,) = run_distributed(_body, 1, args=(str(tmp_path),), timeout=120)
    folder = tmp_path / "ckpt" / "t1"
    assert "cannot save object at 'client.bad'" in r["bad_client"] and "pickle" in r["bad_client"]
    assert r["no_latest"] == (None, None)
    assert str(folder / "model.safetensors") in r["flipped"] and "sha256" in r["flipped"]
    assert str(folder / "optim_rank0.safetensors") in r["truncated"] and "truncated" in r["truncated"]
    assert str(folder / "manifest.json") in r["manifest"] and "corrupted or truncated" in r["manifest"]
    assert "FileNotFoundError" in r["missing_file"] and str(folder / "rank0.json") in r["missing_file"]
    assert "no checkpoint 't9'" in r["missing_tag"] and "tags there: t1" in r["missing_tag"]
    # the manifest checks itself, and lists every file the load needs
    manifest = str(folder / "manifest.json")
    for key in ("edited_shape", "unlisted"):
        assert manifest in r[key] and "changed after it was written" in r[key], (key, r[key])
    assert manifest in r["unlisted_redigested"] and "does not list rank0.json" in r["unlisted_redigested"]
    assert manifest in r["no_digest"] and "has no 'digest'" in r["no_digest"]
    assert "shape mismatch: fc1.bias: checkpoint (13,) vs model (14,)" in r["wider"]
    assert "missing in checkpoint: head.bias, head.weight" in r["renamed"]
    assert "not in model: out.bias, out.weight" in r["renamed"]
    assert "shape mismatch" in r["renamed_lenient_shape"], "shape mismatches are errors even when not strict"
    for name, value in r["saved"].items():
        assert torch.equal(r["lenient"][name], value), name
    assert torch.equal(r["lenient"]["extra"], torch.ones(4))
    assert r["ok"] == str(folder)
    # The refused save left nothing behind but debris the next save clears.
    assert sorted(p for p in os.listdir(tmp_path / "ckpt") if not p.startswith(".")) == ["latest", "t1", "zero_to_fp32.py"]


def test_tag_resolution_without_an_engine(tmp_path):
    from shardwise.checkpoint import list_tags, open_checkpoint

    assert open_checkpoint(tmp_path) is None and list_tags(tmp_path / "nothing") == []
    with pytest.raises(FileNotFoundError, match="tags there: none"):
        open_checkpoint(tmp_path, tag="x")
    # a non-UTF-8 'latest' is named with its path (not a bare "'utf-8' codec can't decode byte")
    (tmp_path / "latest").write_bytes(b"global_step\xe9")
    with pytest.raises(ValueError) as info:
        open_checkpoint(tmp_path)
    assert str(tmp_path / "latest") in str(info.value) and "not UTF-8" in str(info.value)


def test_latest_is_read_defensively_by_both_formats(tmp_path):
    """The DeepSpeed-format detector runs first on every load; a non-UTF-8 'latest' is an error naming
    the file (not a bare UnicodeDecodeError), and a tag leading out of the folder is refused by both formats."""
    from shardwise.checkpoint import open_checkpoint
    from shardwise.checkpoint.deepspeed_format import find_deepspeed_folder, is_deepspeed_checkpoint

    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    latest = save_dir / "latest"
    latest.write_bytes(b"global_step\xff1")
    with pytest.raises(ValueError) as info:
        is_deepspeed_checkpoint(save_dir)
    assert str(latest) in str(info.value) and "not UTF-8" in str(info.value)
    # a DeepSpeed checkpoint beside the folder, which 'latest' points at
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mp_rank_00_model_states.pt").write_bytes(b"not read")
    assert find_deepspeed_folder(tmp_path, tag="outside") == outside  # a tag names a folder inside the directory
    for tag in ("../outside", "..", "sub\\..\\..\\outside"):
        latest.write_text(tag)
        for read in (find_deepspeed_folder, open_checkpoint):
            with pytest.raises(ValueError) as info:
                read(save_dir)
            assert str(latest) in str(info.value) and "does not hold a checkpoint tag" in str(info.value), \
                (read.__name__, tag, str(info.value))
