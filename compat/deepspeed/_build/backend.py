"""setuptools' build backend, plus one check: do not replace a real DeepSpeed by accident.

pip builds this distribution in the environment it installs into (``sys.prefix`` is the target
even under build isolation), so the target's site-packages can be read here, before pip uninstalls
anything. A ``deepspeed`` there whose version is not ``...+shardwise...`` is a real DeepSpeed: the
build stops with a message, unless pip was given ``--force-reinstall`` (or ``PIP_FORCE_REINSTALL=1``,
the same option as an environment variable).
"""
from __future__ import annotations

import os
import sysconfig
from importlib import metadata

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook setuptools provides)


def _installed_deepspeed() -> tuple[str, str] | None:
    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    for dist in metadata.distributions(path=paths):
        if (dist.metadata["Name"] or "").lower() == "deepspeed":
            return dist.version, str(dist.locate_file(""))
    return None


def _forced() -> bool:
    if os.environ.get("PIP_FORCE_REINSTALL", "").lower() in ("1", "true", "yes", "on"):
        return True
    pid = os.getppid()  # the backend runs under pip (maybe through a wrapper): look up a few parents
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if b"--force-reinstall" in args:
            return True
        if pid <= 1:
            return False
    return False


def _check_target() -> None:
    found = _installed_deepspeed()
    if found is None or "+shardwise" in found[0] or _forced():
        return
    version, where = found
    raise SystemExit(
        f"\n[shardwise] refusing to install the 'deepspeed' compatibility package: a real DeepSpeed {version} "
        f"is installed in {where}.\nInstalling this package would replace it with shardwise under the name "
        "'deepspeed'. If that is what you want, repeat the command with --force-reinstall; otherwise keep "
        "DeepSpeed and use 'import shardwise as deepspeed' in your own scripts.\n")


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _check_target()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _check_target()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _check_target()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
