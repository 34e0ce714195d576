"""Where one head sub-range of a block run lies in two pools that split the heads differently.

A block is ``[num_layers, 2, block_size, heads, head_dim]``, so a head sub-range of a run
of n blocks is ``n * num_layers * 2 * block_size`` equally spaced rows of
``count * head_nbytes`` bytes: a 2D (pitched) region on each side, with the producer
rank's pitch on one side and the consumer rank's on the other. Each data plane moves such
a region its own way (``transfer.plane``); this module only does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.kv_layout import KVLayout
from transfer.tp_plan import Part, is_latent, part_between


class Rows(NamedTuple):
    """A pitched byte region of a pool: ``rows`` rows of ``width`` bytes, ``pitch`` apart."""

    offset: int  # of the first row, from the pool's first byte
    rows: int
    width: int
    pitch: int

    @property
    def end(self) -> int:
        """One past the last byte touched (bounds checks)."""
        return self.offset + (self.rows - 1) * self.pitch + self.width


@dataclass(frozen=True)
class HeadCut:
    """The part of every block one producer rank sends one consumer rank."""

    src_first: int  # first head of the part among the producer pool's heads
    dst_first: int  # ... among the consumer pool's heads
    count: int  # heads in the part
    src_heads: int  # heads per token in the producer rank's pool
    dst_heads: int  # ... in the consumer rank's pool
    head_nbytes: int  # head_dim * dtype size
    rows_per_block: int  # num_layers * 2 * block_size

    @classmethod
    def of(cls, part: Part, src: KVLayout, dst: KVLayout) -> HeadCut:
        return cls(part.src_first, part.dst_first, part.num_heads, src.head_count, dst.head_count,
                   src.head_nbytes, src.num_layers * 2 * src.block_size)

    @property
    def whole(self) -> bool:
        """Whole blocks move (both pools hold exactly the part's heads): a plain run."""
        return self.count == self.src_heads == self.dst_heads

    @property
    def src_block_nbytes(self) -> int:
        return self.rows_per_block * self.src_heads * self.head_nbytes

    @property
    def dst_block_nbytes(self) -> int:
        return self.rows_per_block * self.dst_heads * self.head_nbytes

    def nbytes(self, num_blocks: int) -> int:
        """Payload bytes of a run of ``num_blocks``: what crosses the wire."""
        return num_blocks * self.rows_per_block * self.count * self.head_nbytes

    def src_rows(self, start_block: int, num_blocks: int) -> Rows:
        return Rows(start_block * self.src_block_nbytes + self.src_first * self.head_nbytes,
                    num_blocks * self.rows_per_block, self.count * self.head_nbytes,
                    self.src_heads * self.head_nbytes)

    def dst_rows(self, start_block: int, num_blocks: int) -> Rows:
        return Rows(start_block * self.dst_block_nbytes + self.dst_first * self.head_nbytes,
                    num_blocks * self.rows_per_block, self.count * self.head_nbytes,
                    self.dst_heads * self.head_nbytes)


def cut_between(src: KVLayout, dst: KVLayout) -> HeadCut | None:
    """The cut producer pool ``src`` sends consumer pool ``dst`` (None: no heads)."""
    part = part_between(src.tp_rank, dst.tp_rank, src.tp_size, dst.tp_size, src.num_kv_heads,
                        is_latent(src))
    return None if part is None else HeadCut.of(part, src, dst)
