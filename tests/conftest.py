"""Shared pytest setup: make the helpers in tests/ (e.g. ``distributed``) importable."""
import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# ZeRO++'s quantizer runs eagerly in the suite (no torch.compile in every rank of every multi-process
# test); tests/test_quantize_compiled.py checks that the compiled functions give the same bits.
os.environ.setdefault("SHARDWISE_ZEROPP_COMPILE", "0")
