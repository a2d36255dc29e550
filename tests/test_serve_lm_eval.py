"""lm-evaluation-harness scores a model served by `shardwise serve` exactly as it scores the model
in-process (issue 42): its ``local-completions`` model (completions with ``echo`` and
``logprobs``) against its ``hf`` model, for the base model and a LoRA adapter chosen per request.
The check itself is ``benchmarks/lm_eval_check.py``."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("lm_eval")  # shardwise[dev] installs it
pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import lm_eval_check  # noqa: E402
from test_serve_openai import make_adapter  # noqa: E402


def test_local_completions_loglikelihoods_equal_hf(tmp_path):
    model = lm_eval_check.tiny_model(str(tmp_path))
    adapter = make_adapter(model, str(tmp_path / "lora"), seed=1)
    results = lm_eval_check.compare(model, {"sql": adapter}, str(tmp_path))
    assert set(results) == {"base", "sql"}
    for name, (hf, served) in results.items():
        assert len(hf) == len(served) == len(lm_eval_check.DOCS)
        assert max(abs(a - b) for a, b in zip(hf, served)) <= 1e-4, (name, hf, served)
    assert max(abs(a - b) for a, b in zip(results["base"][0], results["sql"][0])) > 0.1  # the adapter counts
