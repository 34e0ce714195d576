"""Penalty state kept on the device between steps: per request, the output-token counts
and the prompt's token mask, updated from the ids each step sampled (still on the device
when a deferred step reads them) instead of rebuilt from Python lists every step.

A request's state is rebuilt from its lists only when it is new here, or its outputs no
longer extend what was counted (e.g. a different request object under the same id); a
request absent from a step is dropped, so the state never holds more rows than a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import PLACEHOLDER, Request


@dataclass
class _Row:
    req: Request  # held, so its id() is not reused while the row lives
    counts: torch.Tensor  # [V] float32 on the device: output-token counts
    prompt: torch.Tensor  # [V] bool on the device: tokens of the prompt
    counted: int  # how many of req.output_token_ids `counts` holds


class PenaltyState:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self._rows: dict[int, _Row] = {}
        self.num_rebuilds = 0  # rows built from the lists (tests read it)

    def _rebuild(self, r: Request) -> _Row:
        self.num_rebuilds += 1
        counts = torch.zeros(self.vocab, dtype=torch.float32)
        prompt = torch.zeros(self.vocab, dtype=torch.bool)
        prompt[r.prompt_token_ids] = True
        return _Row(r, counts.to(self.device), prompt.to(self.device), 0)

    def tensors(self, reqs: list[Request], prev_ids: torch.Tensor | None,
                prev_rows: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, V] float32 output counts and [S, V] bool seen mask (prompt or output) for
        ``reqs``; a trailing PLACEHOLDER output is the previous step's row
        ``prev_rows[id(r)]`` of ``prev_ids`` (device)."""
        rows: list[_Row] = []
        host_at: list[int] = []  # (row, token) pairs known on the host, not yet counted
        host_tok: list[int] = []
        dev_at: list[int] = []  # rows whose next token is still on the device
        dev_from: list[int] = []
        for i, r in enumerate(reqs):
            row = self._rows.get(id(r))
            outs = r.output_token_ids
            if row is None or row.req is not r or row.counted > len(outs):
                row = self._rebuild(r)
            for t in outs[row.counted:]:
                if t == PLACEHOLDER:
                    dev_at.append(i)
                    dev_from.append(prev_rows[id(r)])
                else:
                    host_at.append(i)
                    host_tok.append(t)
            row.counted = len(outs)
            rows.append(row)
        counts = torch.stack([row.counts for row in rows])  # a fresh [S, V]: rows alias it
        if host_at:
            idx = torch.tensor([host_at, host_tok], dtype=torch.int64).to(self.device)
            counts.index_put_((idx[0], idx[1]), torch.ones(len(host_at), device=self.device),
                              accumulate=True)
        if dev_at:
            assert prev_ids is not None
            idx = torch.tensor([dev_at, dev_from], dtype=torch.int64).to(self.device)
            counts.index_put_((idx[0], prev_ids[idx[1]]),
                              torch.ones(len(dev_at), device=self.device), accumulate=True)
        for i, row in enumerate(rows):
            row.counts = counts[i]
        self._rows = {id(row.req): row for row in rows}
        seen = torch.stack([row.prompt for row in rows]) | (counts > 0)
        return counts, seen
