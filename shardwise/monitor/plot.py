"""``shardwise plot RUN_DIR``: PNG charts from the CSV monitor's files.

RUN_DIR is a ``csv_monitor`` folder (``output_path/job_name``) holding ``<tag>.csv`` files, or a
folder of such folders, whose runs are then drawn on the same axes. Every series becomes one
chart; the standard ones get stable names: ``loss.png``, ``lr.png``, ``throughput.png``,
``step_time.png``, ``grad_norm.png``, ``loss_scale.png``. The x-axis of ``Train/Samples/*``
tags is the number of samples seen (DeepSpeed's convention).
"""

from __future__ import annotations

import csv
import glob
import math
import os

_NAMES = {
    "Train_Samples_train_loss": ("loss", "training loss"),
    "Train_Samples_lr": ("lr", "learning rate"),
    "Train_Samples_samples_per_sec": ("throughput", "throughput (samples/s)"),
    "Train_Samples_step_time_ms": ("step_time", "step time (ms)"),
    "Train_Samples_grad_norm": ("grad_norm", "gradient norm (before clipping)"),
    "Train_Samples_loss_scale": ("loss_scale", "fp16 loss scale"),
}


def read_series(csv_path: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one monitor CSV; repeated header lines (appended runs) are skipped."""
    xs, ys = [], []
    with open(csv_path, newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row or row[0] == "step":
                continue
            try:
                xs.append(float(row[0]))
                ys.append(float(row[1]))
            except (ValueError, IndexError):
                raise ValueError(f"{csv_path}:{lineno}: expected 'step,value', got {','.join(row)!r}") from None
    return xs, ys


def find_runs(run_dir: str) -> dict[str, str]:
    """{run label: folder with CSV files}: RUN_DIR itself, or its sub-folders."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"plot: {run_dir} is not a folder")
    if glob.glob(os.path.join(run_dir, "*.csv")):
        return {os.path.basename(os.path.normpath(run_dir)): run_dir}
    runs = {os.path.basename(d): d for d in sorted(glob.glob(os.path.join(run_dir, "*")))
            if os.path.isdir(d) and glob.glob(os.path.join(d, "*.csv"))}
    if not runs:
        raise ValueError(f"plot: no CSV monitor files (*.csv) in {run_dir} or its sub-folders; "
                         "enable \"csv_monitor\" in the config and give its output_path/job_name folder")
    return runs


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Draw every series of RUN_DIR into ``out_dir`` (default ``RUN_DIR/plots``); return the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = find_runs(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    stems = sorted({os.path.splitext(os.path.basename(p))[0] for d in runs.values() for p in glob.glob(f"{d}/*.csv")})
    written = []
    for stem in stems:
        name, title = _NAMES.get(stem, (stem, stem.replace("_", "/")))
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, folder in runs.items():
            path = os.path.join(folder, stem + ".csv")
            if os.path.exists(path):
                xs, ys = read_series(path)
                ax.plot(xs, ys, label=label, marker="." if len(xs) < 50 else None)
        ax.set_title(title)
        ax.set_xlabel("samples" if stem.startswith("Train_Samples_") else "step")
        if name in ("loss", "loss_scale") and _all_positive(ax) and _spans_decades(ax):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _values(ax) -> list[float]:
    return [y for line in ax.get_lines() for y in line.get_ydata()]


def _all_positive(ax) -> bool:
    return all(v > 0 for v in _values(ax))


def _spans_decades(ax) -> bool:
    vals = _values(ax)
    return bool(vals) and math.log10(max(vals) / min(vals)) >= 2
