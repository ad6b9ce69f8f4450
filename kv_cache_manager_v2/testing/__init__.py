"""Test support shipped with the package: the content-checking ``FakeEngine``."""

from .fake_engine import ContentError, FakeEngine

__all__ = ["ContentError", "FakeEngine"]
