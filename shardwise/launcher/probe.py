"""What ``shardwise doctor`` runs on each host. Standalone: the doctor sends this file's
source to ``python -c`` over ssh, so it works even where shardwise is missing, and it
imports nothing heavy (versions come from package metadata, not from importing torch).

    probe [--script PATH]                    versions and the script's sha256, as JSON
    probe --listen ADDR:PORT --seconds S     bind the port (reports if it is in use), print
                                             one JSON line, accept connections for S seconds
    probe --connect ADDR:PORT --seconds S    try to open a TCP connection to the port
"""
import argparse
import hashlib
import json
import os
import platform
import select
import socket
import sys
import time


def _version(dist):
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - python < 3.8
        return None
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _sha256(path):
    if not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def _emit(obj):
    print(json.dumps(obj), flush=True)


def main(argv):
    p = argparse.ArgumentParser(prog="probe")
    p.add_argument("--script")
    p.add_argument("--listen")
    p.add_argument("--connect")
    p.add_argument("--seconds", type=float, default=10.0)
    a = p.parse_args(argv)
    if a.listen:
        host, port = _addr(a.listen)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            _emit({"listen": False, "error": exc.strerror or str(exc)})
            return
        s.listen(64)
        _emit({"listen": True})
        # Serve until the doctor closes our stdin (the ssh session) or the time is up.
        end = time.monotonic() + a.seconds
        watched = [s, sys.stdin]
        while time.monotonic() < end:
            ready, _, _ = select.select(watched, [], [], 0.2)
            if s in ready:
                conn, _ = s.accept()
                conn.close()
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
                break
        s.close()
        return
    if a.connect:
        host, port = _addr(a.connect)
        try:
            socket.create_connection((host, port), timeout=a.seconds).close()
            _emit({"connect": True})
        except OSError as exc:
            reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
            _emit({"connect": False, "error": reason})
        return
    _emit({"hostname": socket.gethostname(), "python": platform.python_version(),
           "executable": sys.executable, "torch": _version("torch"),
           "shardwise": _version("shardwise"),
           "script": _sha256(a.script) if a.script else None})


if __name__ == "__main__":
    main(sys.argv[1:])
