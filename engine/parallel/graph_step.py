"""A pure-decode step under tensor parallelism: what rank 0 staged for its decode graphs,
sent to every follower so each writes the same rows into its own persistent buffers and
replays the same captured graphs.

Every rank holds a DecodeGraphs of the same sizes, captured in the same order, so the
collectives inside the graphs (one all-reduce per attention and per MLP block, the
embedding's all-reduce, the LM head's all-gather) pair up across ranks on every replay.
The head graph samples from the gathered logits, which are the same bytes on every rank,
with the same seeds, so every rank draws the same ids into its own ``sampled`` buffer and
nothing is broadcast. Rows that need the eager sampler (top-k/p, penalties, ...) take the
hidden states out of the forward graph; then every rank computes the (gathered) logits of
the same rows and rank 0 broadcasts what it sampled, as in an eager step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from engine.decode_graphs import DecodeGraphs
from engine.parallel.group import TPGroup


@dataclass
class GraphStep:
    KIND: ClassVar[str] = "graph"  # on the rank channel (engine.parallel.messages)
    padded: int  # the captured size replayed
    ints: np.ndarray  # [INT_ROWS, padded] int64: the staged rows (engine.decode_graphs)
    temps: np.ndarray  # [padded] float32
    edit_at: np.ndarray  # flat indices into the block table that change ...
    edit_to: np.ndarray  # ... and the block ids they take
    copy_prev: int  # > 0: first put the previous step's this many sampled ids in `sampled`
    head: bool  # every row samples simply: replay the head graph
    logit_rows: list[int] | None  # eager sampling: these rows of the hidden states (None: all)
    batch: int  # real rows (the rest are padding)
    samples: bool  # any row samples at all


def apply_graph_step(graphs: DecodeGraphs, step: GraphStep, prev_ids: torch.Tensor | None,
                     group: TPGroup, device: torch.device) -> torch.Tensor | None:
    """A follower's half of rank 0's graph step; returns the ids this step sampled (on the
    device) as the next step's ``prev_ids``, or None when nothing was sampled."""
    b, n = graphs.buf, step.padded
    b.ints[:, :n].copy_(torch.from_numpy(step.ints))
    b.temperature[:n].copy_(torch.from_numpy(step.temps))
    if len(step.edit_at):
        at = torch.from_numpy(step.edit_at).to(device)
        b.block_tables.view(-1)[at] = torch.from_numpy(step.edit_to).to(
            device=device, dtype=b.block_tables.dtype)
    if step.copy_prev:
        assert prev_ids is not None, "rank 0 copies ids this rank never saw"
        b.sampled[:step.copy_prev].copy_(prev_ids[:step.copy_prev])
    hidden = graphs.replay(n)
    if not step.samples:
        return None
    if step.head:
        return graphs.replay_head(n)[:step.batch]
    rows = hidden[:step.batch] if step.logit_rows is None else \
        hidden[torch.tensor(step.logit_rows, dtype=torch.int64).to(device)]
    graphs.model.compute_logits(rows)  # its all-gather pairs with rank 0's
    return group.broadcast(torch.empty(rows.shape[0], dtype=torch.int64, device=device), 0)
