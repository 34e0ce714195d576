"""Decode staging keeps the device block table and uploads only the entries that changed."""

from __future__ import annotations

import torch

from engine.decode_graphs import INT_ROWS
from engine.input_staging import DecodeStaging


def _step(st: DecodeStaging, table: torch.Tensor, rows: list[list[int]]) -> int:
    ints, temps = st.begin()
    assert ints.shape == (INT_ROWS, 4) and temps.shape == (4,)
    for i, blocks in enumerate(rows):
        st.table_row(i, blocks)
    edits = st._num_edits
    st.upload(torch.zeros(INT_ROWS, 4, dtype=torch.int64), torch.zeros(4), table)
    for i, blocks in enumerate(rows):
        assert table[i, :len(blocks)].tolist() == blocks
    return edits


def test_table_rows_upload_only_what_changed():
    st = DecodeStaging(4, 6, torch.device("cpu"))
    table = torch.full((4, 6), -7, dtype=torch.int32)
    a, b, c = [3, 9], [4], [8, 1, 2]
    assert _step(st, table, [a, b, c]) == 6  # first sight: every entry
    assert _step(st, table, [a, b, c]) == 0  # a steady batch moves no table bytes
    b.extend([5, 6])  # a request's blocks grow in place: only its new entries move
    assert _step(st, table, [a, b, c]) == 2
    assert table[1, :3].tolist() == [4, 5, 6]
    # a request left: the rows after it now hold other requests and are rewritten
    assert _step(st, table, [a, c]) == 3
    # the same request's blocks freed and reallocated (a new list) are rewritten, even
    # when no longer than what the row held
    a2 = [7, 0]
    assert _step(st, table, [a2, c]) == 2
    st.invalidate_tables()
    assert _step(st, table, [a2, c]) == 5
