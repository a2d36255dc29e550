"""Launcher test script: fails on the first attempt, succeeds when the agent restarts it."""
import os
import sys

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt}", flush=True)
if attempt == 0:
    sys.exit(7)
