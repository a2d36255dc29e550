#!/usr/bin/env python3
"""Run DeepSpeed's unit-test tarball file by file under one venv, recording every test's outcome.

The shared harness (../shared/deepspeed-unit-tests/run.sh) runs a whole selection in one pytest session;
on a loaded two-core machine a session over the whole tarball takes hours and one wedged file holds up the
rest. This runs the same harness setup (its tarball, its common.py patch, its plugins and environment)
one test file at a time, niced, each file under a wall-clock cap, so a long file only costs its cap and
the outcomes of finished files are kept. A rerun skips the files already done.

Usage:
  dsu_per_file.py VENV NODES OUTDIR [--hang S] [--file-cap S] [--skip PREFIX ...] [--smallest-first] [--after DIR]
    VENV      a venv with real DeepSpeed 0.19.8 or shardwise + compat/deepspeed (see run.sh's header)
    NODES     node ids, one a line (e.g. the tarball's collected ids)
    OUTDIR    results.jsonl (the harness's dsu_record lines, every file appended), files.jsonl (one line a
              file: rc, seconds), src/ (the unpacked tests)
    --hang    DS_UNITTEST_TIMEOUT: seconds a distributed test may run before it counts as hung (run.sh: 100)
    --file-cap  seconds one file may take in all; tests a capped file did not reach count as "not run"
    --skip    node-id prefixes not to run (GPU-only by construction: FastGen kernels, CUDA-kernel ops)
    --smallest-first  run the files with the fewest selected tests first (most files reached in a short run)
    --after   another OUTDIR of this tool: run only the ids that passed there (e.g. the compat pass after
              the DeepSpeed pass), waiting for each of its files to finish
  dsu_per_file.py --summary OUTDIR NODES   print passed/failed/not-run counts for NODES from OUTDIR
  dsu_per_file.py --passed OUTDIR NODES    print the ids of NODES that passed in OUTDIR, one a line
  dsu_per_file.py --failed OUTDIR NODES    print "id :: outcome" for the ids of NODES that did not pass
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HARNESS = Path(os.environ.get("DSU_HARNESS", Path(__file__).resolve().parents[3] / "shared" / "deepspeed-unit-tests"))


def outcomes(results: Path) -> dict:
    """nodeid -> "passed" / "failed: msg" / "skipped: msg" / "error: msg" (the harness's rule: a test passed
    when its call phase passed and no phase failed)."""
    res: dict = {}
    if not results.exists():
        return res
    for line in results.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r["when"] == "collect":
            res.setdefault("collect:" + r["nodeid"], "collect-error: " + r["msg"][:200])
        elif r["when"] == "call" or r["outcome"] != "passed":
            if r["outcome"] == "passed":
                res.setdefault(r["nodeid"], "passed")
            else:
                res[r["nodeid"]] = f'{r["outcome"]}: {r["msg"][:300]}'
    return res


def node_outcome(res: dict, node: str) -> str:
    if node in res:
        return res[node]
    file = node.split("::")[0]
    for k, v in res.items():
        if k.startswith("collect:") and file.startswith(k[8:]):
            return v
    return "not run"


def unpack(out: Path) -> Path:
    src = out / "src"
    if not (src / "tests").is_dir():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(HARNESS / "deepspeed-tests-edaa722.tar.gz") as t:
            t.extractall(src, filter="fully_trusted")
        common = src / "tests" / "unit" / "common.py"
        if "[dsunit harness patch]" not in common.read_text():
            subprocess.run(["patch", "-s", "-p0", str(common)], stdin=open(HARNESS / "common_py_harness.patch"),
                           check=True)
    return src / "tests"


def run_file(venv: Path, tests: Path, out: Path, file: str, nodes: list, hang: int, cap: int) -> dict:
    sel = out / "sel" / (file.replace("/", "__") + ".txt")
    sel.parent.mkdir(parents=True, exist_ok=True)
    sel.write_text("\n".join(nodes) + "\n")
    (out / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", LOCAL_SIZE="2",
               DS_UNITTEST_TIMEOUT=str(hang), DSU_PRELOAD="1", PYTHONPATH=str(HARNESS / "plugins"),
               TMPDIR=str(out / "tmp"), DSU_RECORD_OUT=str(out / "results.jsonl"), DSU_SELECT=str(sel))
    cmd = ["timeout", "-k", "10", str(cap), "nice", "-n", "15", str(venv / "bin" / "python"), "-m", "pytest",
           "-p", "no:cacheprovider", "-p", "dsu_record", "-p", "dsu_select", "--timeout", str(hang + 20), "-q",
           "--continue-on-collection-errors", file]
    t0 = time.time()
    with open(out / "log.txt", "a") as log:
        log.write(f"\n===== {file} ({len(nodes)} tests)\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True).returncode
    return {"file": file, "tests": len(nodes), "rc": rc, "seconds": round(time.time() - t0, 1),
            "capped": rc in (124, 137)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--passed", action="store_true")
    ap.add_argument("--failed", action="store_true")
    ap.add_argument("args", nargs="+")
    ap.add_argument("--hang", type=int, default=100)
    ap.add_argument("--file-cap", type=int, default=900)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--after")
    ap.add_argument("--smallest-first", action="store_true")
    a = ap.parse_args()
    if a.summary or a.passed or a.failed:
        out, nodes = Path(a.args[0]), [l.strip() for l in open(a.args[1]) if l.strip()]
        res = outcomes(out / "results.jsonl")
        if a.passed or a.failed:
            for n in nodes:
                o = node_outcome(res, n)
                if a.passed and o == "passed":
                    print(n)
                elif a.failed and o != "passed":
                    print(f"{n} :: {o}")
            return 0
        counts: dict = {}
        for n in nodes:
            o = node_outcome(res, n).split(":")[0]
            counts[o] = counts.get(o, 0) + 1
        print(json.dumps(counts), f"passed {counts.get('passed', 0)} of {len(nodes)}")
        return 0
    venv, nodes_file, out = Path(a.args[0]).resolve(), a.args[1], Path(a.args[2]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tests = unpack(out)
    nodes = [l.strip() for l in open(nodes_file) if l.strip() and not any(l.startswith(p) for p in a.skip)]
    by_file: dict = {}
    for n in nodes:
        by_file.setdefault(n.split("::")[0], []).append(n)
    if a.smallest_first:
        by_file = dict(sorted(by_file.items(), key=lambda kv: len(kv[1])))
    done_path = out / "files.jsonl"
    done = {json.loads(l)["file"] for l in done_path.read_text().splitlines()} if done_path.exists() else set()
    for file, fnodes in by_file.items():
        if file in done:
            continue
        if a.after:
            before = Path(a.after)
            while True:
                fin = {json.loads(l)["file"] for l in (before / "files.jsonl").read_text().splitlines()} \
                    if (before / "files.jsonl").exists() else set()
                if file in fin:
                    break
                time.sleep(20)
            res = outcomes(before / "results.jsonl")
            fnodes = [n for n in fnodes if res.get(n) == "passed"]
            if not fnodes:
                with open(done_path, "a") as f:
                    f.write(json.dumps({"file": file, "tests": 0, "rc": None, "seconds": 0}) + "\n")
                continue
        r = run_file(venv, tests, out, file, fnodes, a.hang, a.file_cap)
        with open(done_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
