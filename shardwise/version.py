"""The library version (also in pyproject.toml), importable without importing the package body."""

__version__ = "0.1.0"
