"""BlockMode: what happens to one transformer block's saved activations, and the layout rule
that turns the counts the search picks (n_ssd, n_swap, n_checkpoint, n_selective) and where
the checkpointed blocks keep their inputs (``ckpt_input``) into per-block modes."""
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
    SSD = "ssd"
    """Write saved tensors to NVMe in forward (SSDTrain; GPUDirect Storage when available),
    read them back one block ahead of the block's backward."""
    SELECTIVE = "selective"
    """Long-context selective checkpointing (AutoSP): keep the block input, the attention
    operator's outputs and the sequence-parallel all-to-all outputs; recompute everything else
    (projections, norms, MLP) at the start of the block's backward. Attention (s^2 FLOPs) and
    collectives are never re-run (protrain.runtime.selective)."""
    CKPT_HOST = "ckpt_host"
    """CKPT with the block input in pinned host memory: copied off the device on the offload
    queue in forward (the copy is all the block keeps), fetched back one block ahead of the
    block's backward, then recomputed from it. The layout's CKPT blocks under
    ``ckpt_input="host"`` (Hugging Face's ``gradient_checkpointing_kwargs={"offload": True}``,
    axolotl's ``activation_offloading``, ALST)."""
    CKPT_SSD = "ckpt_ssd"
    """CKPT with the block input on the drive: written to the block's file on the NVMe path
    (SSDTrain's storage backends) in forward, read back one block ahead of the block's
    backward, then recomputed from it. The layout's CKPT blocks under ``ckpt_input="drive"``."""

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def letter(self) -> str:
        return {"none": "N", "ckpt": "C", "swap": "S", "ssd": "D", "selective": "A",
                "ckpt_host": "H", "ckpt_ssd": "F"}[self.value]


_CODES = {BlockMode.NONE: 0, BlockMode.CKPT: 1, BlockMode.SWAP: 2, BlockMode.SSD: 3,
          BlockMode.SELECTIVE: 4, BlockMode.CKPT_HOST: 5, BlockMode.CKPT_SSD: 6}
NONE, CKPT, SWAP, SSD, SEL, CKPT_HOST, CKPT_SSD = 0, 1, 2, 3, 4, 5, 6  # codes of the vectorized cost models
RECOMPUTED = (CKPT, SEL, CKPT_HOST, CKPT_SSD)
"""Codes of the modes that recompute (part of) the block in backward."""
FULL_RECOMPUTE = (CKPT, CKPT_HOST, CKPT_SSD)
"""Codes of the modes that recompute the block's whole forward in backward."""
INPUT_MOVED = (CKPT_HOST, CKPT_SSD)
"""Codes of the checkpointed modes whose input leaves the device."""
CKPT_INPUTS = ("device", "host", "drive")
"""Where the checkpointed (CKPT) blocks keep their inputs: ``Knobs.ckpt_input``."""


def full_recompute(codes):
    """Where ``codes`` (an array of mode codes) recompute the whole block's forward."""
    import numpy as np
    return np.isin(codes, FULL_RECOMPUTE)


def layout_block_modes(n_blocks: int, n_swap: int, n_checkpoint: int,
                       n_ssd: int = 0, n_selective: int = 0,
                       ckpt_input: str = "device") -> tuple[BlockMode, ...]:
    """ProTrain's block layout, with SSDTrain's tier in front: offload early (the copies hide
    behind the later blocks' compute and are needed last in backward) - first the SSD blocks
    (the slowest path gets the most time), then the swapped ones -, recompute interleaved
    over the remaining blocks (recompute spread out, prefetches overlap it; of the recomputed
    blocks the full checkpoints come first, then the selective ones), and keep the last blocks
    (freed first in backward, so keeping them costs the least). With ``ckpt_input="host"`` the
    full checkpoints keep their inputs in host memory (CKPT_HOST), with ``"drive"`` on the drive
    (CKPT_SSD)."""
    ckpt = _ckpt_mode(ckpt_input)
    counts = (n_swap, n_checkpoint, n_ssd, n_selective)
    if min(counts) < 0 or sum(counts) > n_blocks:
        raise ValueError(f"n_ssd={n_ssd} + n_swap={n_swap} + n_checkpoint={n_checkpoint} + "
                         f"n_selective={n_selective} must be between 0 and the number of blocks "
                         f"({n_blocks})")
    modes = [BlockMode.NONE] * n_blocks
    for i in range(n_ssd):
        modes[i] = BlockMode.SSD
    for i in range(n_ssd, n_ssd + n_swap):
        modes[i] = BlockMode.SWAP
    first = n_ssd + n_swap
    rest = n_blocks - first
    n_rec = n_checkpoint + n_selective
    for k in range(n_rec):
        modes[first + (k * rest) // n_rec] = ckpt if k < n_checkpoint else BlockMode.SELECTIVE
    return tuple(modes)


def _ckpt_mode(ckpt_input: str) -> BlockMode:
    if ckpt_input not in CKPT_INPUTS:
        raise ValueError(f"ckpt_input={ckpt_input!r}: one of {', '.join(CKPT_INPUTS)}")
    return {"device": BlockMode.CKPT, "host": BlockMode.CKPT_HOST, "drive": BlockMode.CKPT_SSD}[ckpt_input]


def same_counts(a, b) -> bool:
    """Whether two mode sequences hold the same number of blocks in each mode (one may be a
    re-arrangement of the other, e.g. Megatron's native recompute of the first blocks)."""
    return sorted(m.code for m in a) == sorted(m.code for m in b)


def modes_string(modes) -> str:
    """Compact form for logs: 'DSSCNCN...'."""
    return "".join(m.letter for m in modes)


def layout_codes(n_blocks: int, n_swap, n_checkpoint, n_ssd, n_selective=None,
                 ckpt_input: str = "device") -> "np.ndarray":
    """``layout_block_modes`` for many (n_swap, n_checkpoint, n_ssd, n_selective) at once, as a
    [K, n_blocks] int8 matrix of mode codes (the search builds tens of thousands)."""
    ckpt = _ckpt_mode(ckpt_input).code
    import numpy as np
    if n_selective is None:
        n_selective = np.zeros(len(np.atleast_1d(n_swap)), dtype=np.int64)
    ns, nc, nd, nl = (np.asarray(x, dtype=np.int64)[:, None]
                      for x in (n_swap, n_checkpoint, n_ssd, n_selective))
    j = np.arange(n_blocks, dtype=np.int64)[None, :]
    codes = np.where(j < nd, SSD, np.where(j < nd + ns, SWAP, NONE)).astype(np.int8)
    first = nd + ns
    rest = np.maximum(n_blocks - first, 1)
    jr = j - first                                   # index among the non-offloaded blocks
    nr = nc + nl                                     # recomputed blocks
    # recomputed blocks sit at first + floor(k * rest / nr), k < nr: count those at or before jr
    def upto(x):
        return np.minimum(nr, -((-(x + 1) * nr) // np.maximum(rest, 1)))
    k = upto(jr)                                      # recompute slots up to and including jr
    is_rec = (jr >= 0) & (k - upto(jr - 1) > 0) & (nr > 0)
    codes[is_rec & (k - 1 < nc)] = ckpt
    codes[is_rec & (k - 1 >= nc)] = SEL
    return codes

ACTIVATION_FILE_HEADROOM = 1.25
"""A block's activation file on the drive (and its pinned arena) holds this many times the
bytes the plan says the block writes (runtime.activations sizes them so; the planner checks the
drive's free space for it: cost.memory.activation_file_space), ..."""
ACTIVATION_FILE_SLACK = 2**16
"""... plus this many bytes."""


def activation_file_bytes(nbytes: int) -> int:
    """Bytes of the file (or arena) that holds a block's ``nbytes`` of activations."""
    return int(nbytes * ACTIVATION_FILE_HEADROOM) + ACTIVATION_FILE_SLACK
