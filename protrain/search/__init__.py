"""Search: the fastest plan that fits the device and host budgets, and an actionable error
when none does.

    mlp          search(): the MLPs' tile around the head's loop (as P is, in protrain.sp)
    head         the head's tile around the inner search
    tiles        the loop both tile knobs share
    ckpt_input   where the checkpointed blocks keep their inputs, around the inner search
    loop         the inner search: the fastest time in bound order, the hedge band, the fewest buffers, the winner
    space        the candidate space: activation configurations, per chunk size the points that fit
    candidates   the values the candidate space is made of (ActivationConfigs, CandidateGrid)
    bounds       lower bounds on the step time that order and prune the candidates
    evaluation   a plan's predictions (evaluate) and the candidates' simulated step times
    policy       what the runtime does under a PlannerConfig, as the models need it
    diagnosis    no plan fits: which constraint, and what to change
    infeasible   InfeasibleError, and the budget check before profiling
"""
from .evaluation import bytes_moved, evaluate
from .infeasible import InfeasibleError, check_budgets
from .mlp import search
from .loop import hedged_key, plan_key
from .space import max_ssd_blocks, search_floor

__all__ = ["InfeasibleError", "bytes_moved", "check_budgets", "evaluate", "hedged_key", "max_ssd_blocks",
           "plan_key", "search", "search_floor"]
