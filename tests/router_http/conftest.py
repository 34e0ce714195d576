"""The router's HTTP front door, auth, TLS and admission against in-process fake workers
(the router tests' harness), plus the pure pieces; the live-cluster acceptance tests are
in tests/e2e/test_http_api.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "router"))
