"""Orders in which the autotuner tries experiments: gridsearch, random, model_based.

A tuner is asked for the next experiment after every result. All three stop after
``num_trials`` trials or after ``early_stopping`` trials in a row without a new best
(0 turns early stopping off), and skip, within a stage, micro-batch sizes larger than
one that failed (it ran out of memory or crashed).
"""

from __future__ import annotations

import math
import random

import numpy as np

from .space import Experiment


class Tuner:
    def __init__(self, experiments: list[Experiment], *, higher_is_better: bool, num_trials: int,
                 early_stopping: int, seed: int = 0) -> None:
        self.pending = list(experiments)
        self.higher_is_better = higher_is_better
        self.num_trials = num_trials
        self.early_stopping = early_stopping
        self.results: list[tuple[Experiment, float | None]] = []
        self.best: float | None = None
        self._since_best = 0
        self.rng = random.Random(seed)
        self.stop_reason = ""

    def _better(self, a: float, b: float | None) -> bool:
        return b is None or (a > b if self.higher_is_better else a < b)

    def record(self, exp: Experiment, metric: float | None) -> None:
        self.results.append((exp, metric))
        if metric is None:  # failed: larger micro-batches of this stage would fail too
            self.pending = [e for e in self.pending
                            if not (e.stage == exp.stage and e.micro_batch > exp.micro_batch
                                    and e.zero_overrides == exp.zero_overrides)]
        if metric is not None and self._better(metric, self.best):
            self.best, self._since_best = metric, 0
        else:
            self._since_best += 1

    def next(self) -> Experiment | None:
        if len(self.results) >= self.num_trials:
            self.stop_reason = f"reached tuner_num_trials ({self.num_trials})"
            return None
        if self.early_stopping and self._since_best >= self.early_stopping and self.best is not None:
            self.stop_reason = f"no improvement in {self.early_stopping} trials (tuner_early_stopping)"
            return None
        if not self.pending:
            self.stop_reason = "search space exhausted"
            return None
        exp = self._choose()
        self.pending.remove(exp)
        return exp

    def _choose(self) -> Experiment:
        return self.pending[0]


class GridSearchTuner(Tuner):
    """Stage by stage, micro-batch sizes ascending."""


class RandomTuner(Tuner):
    def _choose(self) -> Experiment:
        return self.rng.choice(self.pending)


class ModelBasedTuner(Tuner):
    """Tries each stage's smallest and largest micro-batch, then a middle one, then always the
    untried point that a cost model fitted to the results so far ranks best.

    The model is a least-squares fit of the metric on [stage one-hot, log2 mbs, (log2 mbs)^2]
    over the successful trials (DeepSpeed fits XGBoost on similar features).
    """

    def _choose(self) -> Experiment:
        for stage in sorted({e.stage for e in self.pending}):
            done = sum(1 for e, _ in self.results if e.stage == stage)
            if done < 2:
                ours = sorted((e for e in self.pending if e.stage == stage), key=lambda e: e.micro_batch)
                return ours[0] if done == 0 else ours[-1]
        ok = [(e, m) for e, m in self.results if m is not None]
        sizes = {e.micro_batch for e, _ in ok}
        if len(sizes) < 3:  # a quadratic needs three distinct sizes: take the one nearest the middle
            everything = [e.micro_batch for e in self.pending] + [e.micro_batch for e, _ in self.results]
            middle = math.sqrt(min(everything) * max(everything))
            fresh = [e for e in self.pending if e.micro_batch not in sizes] or self.pending
            return min(fresh, key=lambda e: (round(abs(math.log2(e.micro_batch / middle)), 6), e.stage,
                                             e.micro_batch))
        stages = sorted({e.stage for e in self.pending} | {e.stage for e, _ in ok})

        def features(e: Experiment) -> list[float]:
            lm = math.log2(e.micro_batch)
            return [1.0 if e.stage == s else 0.0 for s in stages] + [lm, lm * lm]

        x = np.array([features(e) for e, _ in ok])
        y = np.array([m for _, m in ok])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        preds = [float(np.dot(features(e), coef)) for e in self.pending]
        pick = int(np.argmax(preds) if self.higher_is_better else np.argmin(preds))
        return self.pending[pick]


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}
