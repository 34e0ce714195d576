"""Makes the fakes importable (importlib import mode adds no test dir to sys.path)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from router_fakes import load_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer()
