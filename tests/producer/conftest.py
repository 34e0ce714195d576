"""Fixtures for the producer role tests."""

from role_harness import tiny_llama  # noqa: F401 - the tiny model fixture
