#!/usr/bin/env bash
# Find every test of DeepSpeed's unit-test tarball that passes under real DeepSpeed 0.19.8 on this CPU harness
# (not only the harness's deepspeed-passing.txt), then run those through the compat package.
# Usage: compat/tools/dsu_discover.sh [WORKDIR]      (default WORKDIR: ./.dsu-discover)
#   env DSU_HARNESS: the harness folder (run.sh, tarball; default ../shared/deepspeed-unit-tests)
# Steps, each kept in WORKDIR so a rerun skips what is done:
#   1. a throwaway venv with real DeepSpeed 0.19.8 (the measuring stick; never a shardwise dependency)
#   2. all-nodes.txt: every test pytest selects in the tarball (its pytest.ini deselects GPU-only markers)
#   3. real/: the harness run over all of them under DeepSpeed; deepspeed-passing-all.txt: those that passed
#   4. compat/: the same tests through compat/deepspeed (compat/run-deepspeed-unit-tests.sh)
# Hours on two cores; run it on a quiet machine (a loaded one makes DeepSpeed's own distributed tests hang
# past the harness's 100 s limit, which then count as not passing).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mkdir -p "${1:-$PWD/.dsu-discover}" && cd "${1:-$PWD/.dsu-discover}" && pwd)
HARNESS=${DSU_HARNESS:-$REPO/../shared/deepspeed-unit-tests}
HARNESS=$(cd "$HARNESS" && pwd) || { echo "no harness: set DSU_HARNESS" >&2; exit 2; }
DSV="$WORK/ds-venv"
if [ ! -f "$DSV/.ready" ]; then
  python3 -m venv "$DSV"
  "$DSV/bin/pip" install -q torch==2.13.0 pytest pytest-timeout
  "$DSV/bin/pip" install -q --no-deps deepspeed==0.19.8 hjson ninja psutil py-cpuinfo msgpack pydantic pydantic-core \
    annotated-types typing-inspection packaging tqdm numpy einops
  touch "$DSV/.ready"
fi
if [ ! -s "$WORK/all-nodes.txt" ]; then
  rm -rf "$WORK/collect" && mkdir -p "$WORK/collect/tmp"
  tar xzf "$HARNESS/deepspeed-tests-edaa722.tar.gz" -C "$WORK/collect"
  (cd "$WORK/collect/tests" && OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu LOCAL_SIZE=2 TMPDIR="$WORK/collect/tmp" \
     PYTHONPATH="$REPO/compat/tools" DSU_IDS_OUT="$WORK/all-nodes.txt" \
     "$DSV/bin/python" -m pytest -p no:cacheprovider -p dsu_ids --collect-only -q --continue-on-collection-errors unit \
     > "$WORK/collect.log" 2>&1)
fi
echo "$(wc -l < "$WORK/all-nodes.txt") tests selected in the tarball"
if [ ! -s "$WORK/deepspeed-passing-all.txt" ]; then
  "$HARNESS/run.sh" "$DSV" "$WORK/all-nodes.txt" "$WORK/real" | tail -1
  "$DSV/bin/python" - "$WORK/real/results.jsonl" > "$WORK/deepspeed-passing-all.txt" <<'PY'
import json, sys
out = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["when"] == "call" or r["outcome"] != "passed":
        out[r["nodeid"]] = out.get(r["nodeid"], r["outcome"]) if r["outcome"] == "passed" else r["outcome"]
print("\n".join(n for n, o in out.items() if o == "passed"))
PY
fi
echo "$(wc -l < "$WORK/deepspeed-passing-all.txt") pass under DeepSpeed 0.19.8"
"$REPO/compat/run-deepspeed-unit-tests.sh" "$WORK/deepspeed-passing-all.txt" "$WORK/compat"
