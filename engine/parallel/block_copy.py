"""Copying KV blocks from the first rank of an attention group to its other ranks.

A replicated latent (MLA: the same bytes in every rank's pool) is received from the
producer by one rank only, so the wire carries it once per request, not once per rank;
this copies the request's blocks from that rank to the rest of its group over the group's
own communicator (gloo on CPU, NCCL on CUDA), before the request's first decode step.

Rank 0 of the engine sends each member follower a ``KvCopy`` behind the step plans sent so
far and joins the broadcast itself when it is a member; every member then runs it in the
same place of its collective order, and any later forward on that rank runs after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.parallel.group import TPGroup


def broadcast_blocks(group: TPGroup, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
    """Group rank 0's blocks ``block_ids`` of ``kv_cache`` [NB, ...] into the same blocks
    of every other rank of ``group``."""
    if not block_ids or group.size == 1:
        return
    idx = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_cache.device)
    # as bytes: gloo and NCCL move float8 (and gloo bfloat16) only as a plain byte type,
    # and CPU indexing kernels skip float8 too
    raw = kv_cache.view(torch.uint8)  # [NB, ..., head_dim * element size]
    rows = raw.index_select(0, idx)  # [n, ...]: the root's blocks; overwritten elsewhere
    group.broadcast(rows, 0)
    if group.rank != 0:
        raw.index_copy_(0, idx, rows)
