"""What an autotuning session leaves behind: per-trial records, a summary table, the best config."""

from __future__ import annotations

import json
import os


def summary_table(tuner, best) -> str:
    unit = tuner.metric_unit
    header = f"{'experiment':<28} {'stage':>5} {'mbs':>5} {'gas':>4} {'status':<18} {tuner.at.metric + ' (' + unit + ')':>26} {'trial s':>8}"
    lines = [header, "-" * len(header)]
    for r in tuner.results:
        v = tuner._value(r)
        mark = "  <- best" if best is not None and r is best else ""
        lines.append(f"{r.name:<28} {r.settings['stage']:>5} {r.settings['micro_batch']:>5} "
                     f"{r.settings['grad_accum']:>4} {r.status:<18} {(f'{v:.4g}' if v is not None else '-'):>26} "
                     f"{r.seconds:>8.1f}{mark}")
    return "\n".join(lines)


def write_results(tuner, best) -> str:
    """Write ``results_dir/{exps.json,summary.txt,ds_config_optimal.json}``; return the summary text."""
    out = tuner.at.results_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "exps.json"), "w") as f:
        json.dump([r.as_dict() for r in tuner.results], f, indent=2)
    text = summary_table(tuner, best)
    if best is None:
        text += "\nno trial produced a metric: see the stdout.log of each experiment under " + tuner.at.exps_dir
    else:
        path = os.path.join(out, "ds_config_optimal.json")
        with open(path, "w") as f:
            json.dump(tuner.optimal_config(best), f, indent=2)
        text += (f"\nbest: {best.name} ({tuner.at.metric} {tuner._value(best):.4g} {tuner.metric_unit}); "
                 f"its config: {path}")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    return text
