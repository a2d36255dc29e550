"""``shardwise plot``: PNG charts from csv_monitor output (one run, or several runs overlaid)."""

from __future__ import annotations

import os

import pytest


def _write_run(folder, job: str, steps: int, scale: float) -> None:
    from shardwise.monitor import CSVMonitor

    mon = CSVMonitor(str(folder), job)
    for s in range(1, steps + 1):
        mon.write_events([("Train/Samples/train_loss", scale * 4.0 / s, 8 * s),
                          ("Train/Samples/lr", 1e-3 * min(1.0, s / 3), 8 * s),
                          ("Train/Samples/samples_per_sec", 100.0 + s, 8 * s),
                          ("Custom/accuracy", s / steps, s)])
    mon.close()


def _png_pixels(path):
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


def test_plot_one_run_and_overlaid_runs(tmp_path, capsys):
    from shardwise.cli import main
    from shardwise.monitor.plot import read_series

    _write_run(tmp_path / "runs", "a", 6, 1.0)
    _write_run(tmp_path / "runs", "a", 2, 1.0)  # a resumed run appends rows to the same files
    xs, ys = read_series(str(tmp_path / "runs" / "a" / "Train_Samples_train_loss.csv"))
    assert xs == [8.0 * s for s in range(1, 7)] + [8.0, 16.0] and ys[1] == 2.0

    assert main(["plot", str(tmp_path / "runs" / "a")]) == 0
    written = capsys.readouterr().out.split()
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["Custom_accuracy.png", "loss.png", "lr.png", "throughput.png"]
    for p in written:
        assert os.path.dirname(p) == str(tmp_path / "runs" / "a" / "plots")
        pixels = _png_pixels(p)
        assert pixels.shape[0] > 100 and pixels.std() > 0.01  # something was drawn

    _write_run(tmp_path / "runs", "b", 4, 2.0)
    out = tmp_path / "charts"
    assert main(["plot", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["Custom_accuracy.png", "loss.png", "lr.png", "throughput.png"]


def test_plot_errors_name_the_problem(tmp_path, capsys):
    from shardwise.cli import main

    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "missing")])
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "no CSV monitor files" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.csv").write_text("step,x\n1,2\noops\n")
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "bad")])
    assert "x.csv:3: expected 'step,value'" in capsys.readouterr().err
