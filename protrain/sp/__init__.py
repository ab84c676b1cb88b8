"""AutoSP: Ulysses sequence parallelism chosen by the planner (degree, constraints, per-rank
profile scaling, the outer search loop) and applied by the runtime (all-to-all attention,
sequence-sharded batches and loss). Framework-neutral: torch.distributed only."""
from .degree import SPShape, broken_constraints, check_degree, valid_degrees
from .planner import search_sequence_parallel
from .scaling import scale_profile

__all__ = ["SPShape", "broken_constraints", "check_degree", "valid_degrees",
           "search_sequence_parallel", "scale_profile"]
