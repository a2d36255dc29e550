#!/usr/bin/env bash
# DeepSpeed's own unit tests through the compat package: the yardstick of "drop-in".
# Builds (once) a venv with the CPU torch, pytest, DeepSpeed's test-only imports (hjson, py-cpuinfo),
# shardwise and compat/deepspeed from this tree (editable), then runs the shared harness over it.
# Usage: compat/run-deepspeed-unit-tests.sh [SELECTION] [OUTDIR]
#   SELECTION: node ids, one a line (default: the harness's deepspeed-passing.txt)
#   env DSU_HARNESS: the harness folder (run.sh, tarball; default ../shared/deepspeed-unit-tests)
#   env DSU_VENV: where the venv lives (default .dsu-venv); env DSU_MIN: exit 1 when fewer pass
# Takes about ten minutes on two cores; not part of `make test`. Prints "passed P of N selected".
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
HARNESS=${DSU_HARNESS:-}
for h in "$HARNESS" "$REPO/../shared/deepspeed-unit-tests" "$REPO/../../shared/deepspeed-unit-tests"; do
  [ -n "$h" ] && [ -x "$h/run.sh" ] && { HARNESS=$(cd "$h" && pwd); break; }
done
[ -x "${HARNESS:-}/run.sh" ] || { echo "no harness: set DSU_HARNESS to the deepspeed-unit-tests folder" >&2; exit 2; }
VENV=${DSU_VENV:-$REPO/.dsu-venv}
if [ ! -f "$VENV/.ready" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 pytest pytest-timeout hjson py-cpuinfo "setuptools>=77"
  "$VENV/bin/pip" install -q -e "$REPO"
  "$VENV/bin/pip" install -q --no-build-isolation -e "$REPO/compat/deepspeed"
  touch "$VENV/.ready"
fi
OUT=${2:-$REPO/.dsu-out}
"$HARNESS/run.sh" "$VENV" "${1:-}" "$OUT" | tee "$OUT.summary.txt"
passed=$(tail -1 "$OUT.summary.txt" | awk '{print $2}')
[ -z "${DSU_MIN:-}" ] || [ "$passed" -ge "$DSU_MIN" ]
