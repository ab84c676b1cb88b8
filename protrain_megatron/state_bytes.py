"""Device bytes of the model states Megatron keeps itself (per rank).

The plan only chooses activation modes; Megatron's parameters, gradient buffer and optimizer
states are a fixed part of every plan's peak, and must be counted right for the budget.
"""
from __future__ import annotations

from dataclasses import dataclass

from protrain.serde import JsonValue


@dataclass(frozen=True, slots=True)
class MegatronStates(JsonValue):
    """What one rank holds for its share of the model."""

    params: int
    """Parameters on this rank (its tensor- and pipeline-parallel share)."""
    param_bytes: int = 2
    """Bytes per parameter as trained (2 for bf16/fp16, 4 for fp32)."""
    grad_bytes: int = 4
    """Bytes per gradient in the DDP buffer (4: Megatron accumulates in fp32 by default)."""
    optimizer_bytes: int = 12
    """Optimizer bytes per parameter: fp32 master copy + Adam's two moments (12), or just
    the moments for fp32 training (8); 0 when the optimizer lives on the host."""
    optimizer_shards: int = 1
    """Ranks the optimizer states are split over: with ``--use-distributed-optimizer`` the
    data-parallel x context-parallel ranks (Megatron shards over the data-parallel group
    with context parallelism, whose ranks hold the same parameters), else 1."""

    def __post_init__(self) -> None:
        for f in ("params", "param_bytes", "grad_bytes", "optimizer_bytes", "optimizer_shards"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0 or (f == "optimizer_shards" and v < 1):
                raise ValueError(f"MegatronStates.{f} must be a non-negative integer"
                                 f"{' >= 1' if f == 'optimizer_shards' else ''}, got {v!r}")

    @property
    def total_bytes(self) -> int:
        p = self.params
        optimizer = -(-p * self.optimizer_bytes // self.optimizer_shards)     # ceil: a rank's shard
        return p * (self.param_bytes + self.grad_bytes) + optimizer

    @classmethod
    def from_args(cls, args, params: int) -> "MegatronStates":
        """From Megatron-LM's parsed arguments (after validate_args)."""
        half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        fp32_grads = (not half) or bool(getattr(args, "accumulate_allreduce_grads_in_fp32", True))
        on_host = bool(getattr(args, "optimizer_cpu_offload", False)) and \
            float(getattr(args, "optimizer_offload_fraction", 1.0)) >= 1.0
        # validate_args sets data_parallel_size = world / (TP x PP x CP); the distributed
        # optimizer shards over data-parallel x context-parallel ranks (within one of its
        # --num-distributed-optimizer-instances).
        shards = 1
        if getattr(args, "use_distributed_optimizer", False):
            dp_cp = int(getattr(args, "data_parallel_size", 1) or 1) * \
                int(getattr(args, "context_parallel_size", 1) or 1)
            shards = max(1, dp_cp // int(getattr(args, "num_distributed_optimizer_instances", 1) or 1))
        return cls(params=int(params), param_bytes=2 if half else 4, grad_bytes=4 if fp32_grads else 2,
                   optimizer_bytes=0 if on_host else (12 if half else 8), optimizer_shards=shards)
