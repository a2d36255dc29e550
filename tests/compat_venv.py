"""A venv where ``deepspeed`` is shardwise's compatibility package (compat/deepspeed), for the tests
that run Hugging Face Trainer / accelerate scripts unchanged.

Built without downloads: the venv sees the running interpreter's site-packages (torch,
transformers, accelerate, ...) through a ``.pth`` file, and gets only ``pip install --no-deps
./compat/deepspeed`` of its own. shardwise itself comes from the tree under test (PYTHONPATH, as for
every test). The venv is cached under ``$SHARDWISE_TEST_CACHE`` (default ~/.cache/shardwise-tests),
keyed by the compat package's files and the base interpreter, so CI builds it once from scratch.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"


def _key() -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in COMPAT.rglob("*") if p.is_file() and "egg-info" not in str(p)
                    and "__pycache__" not in p.parts and "build" not in p.relative_to(COMPAT).parts[:1]):
        h.update(str(f.relative_to(COMPAT)).encode() + b"\0" + f.read_bytes())
    h.update(sys.executable.encode() + sysconfig.get_paths()["purelib"].encode())
    return h.hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("SHARDWISE_TEST_CACHE",
                               Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardwise-tests"))


def compat_venv() -> Path:
    """The venv's root folder (``bin/python``, ``bin/deepspeed``); built on first use."""
    root = cache_root() / f"venv-deepspeed-compat-{_key()}"
    if (root / ".ready").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:  # another test run may be building the same venv
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".ready").exists():
            _build(root)
    return root


def _build(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    base = sysconfig.get_paths()["purelib"]
    # addsitedir (not a bare path line) so the base's own .pth files (editable installs) apply too
    Path(site, "_shardwise_test_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FORCE_REINSTALL")}
    build = root / "build-tmp"
    shutil.copytree(COMPAT, build, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(build)], check=True, env=env, timeout=600)
    shutil.rmtree(build)
    (root / ".ready").touch()


def venv_env(root: Path, **extra: str) -> dict[str, str]:
    """Environment for running in the venv: its bin first, the tree under test importable."""
    env = dict(os.environ)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


if __name__ == "__main__":
    print(compat_venv())


def run_compat_probe(code: str, *, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter where ``deepspeed`` is the compat package (``tests/`` importable
    too) and return the JSON object it prints as its last line (the probes print ``{check: "ok" | error}``)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(COMPAT), str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
