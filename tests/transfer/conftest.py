"""Makes the helpers importable (importlib import mode adds no test dir to sys.path)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from xfer_helpers import BACKENDS, Pair  # noqa: E402


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()
