"""bench/fp8_bench.py's profile section: one point's kernels of the bf16 and FP8 steps side
by side, by name, the largest first; a kernel only one side runs shows 0 on the other."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from fp8_bench import kernel_diff  # noqa: E402


def test_kernels_side_by_side_largest_first():
    bf16 = {"batch": 1, "context": 512, "kernel_ms_per_step": 4.4, "kernels_per_step": 300,
            "kernels": [{"kernel": "gemv_bf16", "ms_per_step": 4.0},
                        {"kernel": "rms_norm", "ms_per_step": 0.2}]}
    fp8 = {"batch": 1, "context": 512, "kernel_ms_per_step": 2.9, "kernels_per_step": 310,
           "kernels": [{"kernel": "_gemv_kernel", "ms_per_step": 2.0},
                       {"kernel": "rms_norm", "ms_per_step": 0.25},
                       {"kernel": "lm_head", "ms_per_step": 0.5}]}
    d = kernel_diff(bf16, fp8)
    assert (d["batch"], d["context"], d["bf16_kernel_ms"], d["fp8_kernel_ms"]) == \
        (1, 512, 4.4, 2.9)
    assert [r["kernel"] for r in d["kernels"]] == ["gemv_bf16", "_gemv_kernel", "lm_head",
                                                   "rms_norm"]
    assert d["kernels"][0] == {"kernel": "gemv_bf16", "bf16_ms": 4.0, "fp8_ms": 0.0}
    assert d["kernels"][3] == {"kernel": "rms_norm", "bf16_ms": 0.2, "fp8_ms": 0.25}


def test_a_failed_point_has_no_kernels():
    d = kernel_diff({"batch": 8, "context": 512, "error": "x"},
                    {"batch": 8, "context": 512, "error": "x"})
    assert d["kernels"] == [] and d["fp8_kernel_ms"] is None
