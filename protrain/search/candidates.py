"""The values of the candidate space: every activation configuration the search may use
(ActivationConfigs), and the points of one chunk size that fit the budgets (CandidateGrid),
each with the columns the search orders and prunes by. search.space builds them;
search.bounds, search.evaluation and the search read them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..block_mode import layout_codes
from ..layout import ChunkLayout


@dataclass
class ActivationConfigs:
    """Every (n_checkpoint, n_swap, n_ssd, n_selective) the search may use, with what depends
    only on them. The block layouts themselves are built only for the configurations
    simulated."""

    n_blocks: int
    n_ckpt: np.ndarray
    n_swap: np.ndarray
    n_ssd: np.ndarray
    n_sel: np.ndarray
    act_peak: np.ndarray       # [A] bytes
    swap_host: np.ndarray      # [A] bytes
    ssd: np.ndarray            # [A] bytes written to NVMe per iteration
    recompute: np.ndarray      # [A] seconds of recompute in backward
    fwd_write: np.ndarray      # [A] seconds forward cannot beat: its compute and swap / SSD writes
    bwd_read: np.ndarray       # [A] seconds backward cannot beat: its compute, recompute and reads
    ckpt_input: str = "device"
    """Where the checkpointed blocks keep their inputs (``Knobs.ckpt_input``)."""

    def codes(self, a: np.ndarray) -> np.ndarray:
        """[len(a), n_blocks] mode codes of configurations ``a``."""
        return layout_codes(self.n_blocks, self.n_swap[a], self.n_ckpt[a], self.n_ssd[a], self.n_sel[a],
                            ckpt_input=self.ckpt_input)


@dataclass
class CandidateGrid:
    """Feasible (activation config, n_persist) points of one chunk size, with derived n_buffer
    and n_nvme."""

    layout: ChunkLayout
    a: np.ndarray
    n_persist: np.ndarray
    n_buffer: np.ndarray
    n_buffer_min: np.ndarray
    peak: np.ndarray
    host: np.ndarray
    lower_bound: np.ndarray
    fwd_lb: np.ndarray
    """Parts of the lower bound, for ``bounds.refine_cpu_bound``: forward, the device's backward
    and optimizer, and the accumulation micro-steps."""
    dev_lb: np.ndarray
    tail_lb: np.ndarray
    moved: np.ndarray
    """Bytes moved per optimizer step (exact: what the simulation counts)."""
    n_nvme: np.ndarray
    """Offloaded chunks (the last ones) whose optimizer states are on the drive."""
    n_shard: np.ndarray
    """Persistent chunks (the last of the n_persist) sharded over the ranks
    (``sharding.fewest_sharded``)."""
