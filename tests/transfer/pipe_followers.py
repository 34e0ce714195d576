"""A stand-in for the engine's follower ranks (TPFollowers, the RankChannel) in one process:
the same encoded bytes as the pipe, each follower rank's transfer side started by the
factory rank 0 names, over that rank's pool shard."""

from __future__ import annotations

import torch

from engine.parallel.rank_side import attach
from transfer.tp_rank_side import TransferRankSide


class PipeFollowers:
    def __init__(self, pools: list[torch.Tensor]) -> None:
        self.pools = pools
        self.sides: dict[int, TransferRankSide] = {}

    def attach(self, factory: str, args: bytes, timeout_s: float = 60.0) -> list[bytes]:
        for r in range(1, len(self.pools)):
            side = attach(factory, self.pools[r], r, len(self.pools), args)
            assert isinstance(side, TransferRankSide)
            self.sides[r] = side
        return [self.sides[r].info() for r in sorted(self.sides)]

    def side(self, rank: int, msg: bytes) -> None:
        assert isinstance(msg, bytes)
        self.sides[rank].on_message(msg)

    def reports(self) -> list[tuple[int, bytes]]:
        return [(r, rep) for r, s in self.sides.items() for rep in s.poll()]
