"""moe_align_multi's three kernels compile for an H200 (sm_90) without a GPU and spill no
registers, at every expert width up to DeepSeek-V3's 256 + 2 (a 512-wide one-hot): ptxas
from Triton's wheel, in a child process (tests/sm90_spills.py; the interpreter, which the
value tests use, compiles nothing)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_moe_align as al

for block_e in (8, 64, 128, 256, 512):
    chunk = al.multi_chunk(block_e)
    out[f"count/{block_e}"] = spills(al._multi_count_kernel, {
        "ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32", "N": "i32", "P": "i32",
        "expert_start": "i32", "num_local": "i32"},
        dict(BLOCK_E=block_e, CHUNK=chunk, FILL=al.FILL_ROWS, PDL=True), num_warps=8)
    for bm, runs in ((16, True), (128, False)):  # the grouped form's 16 rows write the runs
        out[f"place/{block_e}/{bm}"] = spills(al._multi_place_kernel, {
            "ids_ptr": "*i64", "base_ptr": "*i32", "total_ptr": "*i32", "sorted_ptr": "*i32",
            "bexp_ptr": "*i32", "ends_ptr": "*i32", "map_ptr": "*i32", "N": "i32",
            "NUM_TILES": "i32", "expert_start": "i32", "num_local": "i32"},
            dict(BLOCK_E=block_e, CHUNK=chunk, BLOCK_M=bm, BLOCK_T=al.PLACE_T, RUNS=runs,
                 PDL=True), num_warps=8)
out["scan"] = spills(al._multi_scan_kernel, {
    "counts_ptr": "*i32", "base_ptr": "*i32", "total_ptr": "*i32", "num_chunks": "i32",
    "num_local": "i32"}, dict(SCAN_E=al.SCAN_E, SCAN_C=al.SCAN_C, PDL=True), num_warps=4)
'''


@pytest.mark.slow
def test_multi_align_kernels_compile_for_sm90_without_spills() -> None:
    found = spill_bytes(BODY)
    assert len(found) == 5 * 3 + 1, sorted(found)
    assert {k: v for k, v in found.items() if v} == {}, found
