"""Makes the hand-made profiles importable (importlib import mode adds no test dir to sys.path)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
