"""BlockMode: what happens to one transformer block's saved activations, and the layout rule
that turns the counts the search picks (n_swap, n_checkpoint) into per-block modes."""
from __future__ import annotations

import enum


class BlockMode(str, enum.Enum):
    NONE = "none"
    """Keep every saved tensor on the device until backward."""
    CKPT = "ckpt"
    """Keep only the block input; recompute the block's forward at the start of its backward."""
    SWAP = "swap"
    """Copy saved tensors to pinned host memory in forward; prefetch them back one block ahead
    of the block's backward."""

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def letter(self) -> str:
        return {"none": "N", "ckpt": "C", "swap": "S"}[self.value]


_CODES = {BlockMode.NONE: 0, BlockMode.CKPT: 1, BlockMode.SWAP: 2}
NONE, CKPT, SWAP = 0, 1, 2  # integer codes used by the vectorized cost models


def layout_block_modes(n_blocks: int, n_swap: int, n_checkpoint: int) -> tuple[BlockMode, ...]:
    """ProTrain's block layout: swap early (their copies hide behind the later blocks' compute
    and are needed last in backward), checkpoint interleaved over the remaining blocks (so
    recompute is spread out and swap prefetches overlap it), and keep the last blocks (their
    activations are freed first in backward, so keeping them costs the least)."""
    if n_swap < 0 or n_checkpoint < 0 or n_swap + n_checkpoint > n_blocks:
        raise ValueError(f"n_swap={n_swap} + n_checkpoint={n_checkpoint} must be between 0 and the "
                         f"number of blocks ({n_blocks})")
    modes = [BlockMode.NONE] * n_blocks
    for i in range(n_swap):
        modes[i] = BlockMode.SWAP
    rest = n_blocks - n_swap
    for k in range(n_checkpoint):
        modes[n_swap + (k * rest) // n_checkpoint] = BlockMode.CKPT
    return tuple(modes)


def modes_string(modes) -> str:
    """Compact form for logs: 'SSCNCN...'."""
    return "".join(m.letter for m in modes)
