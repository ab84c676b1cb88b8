"""The planning session both adapters run: the deciding rank of a group loads a plan file or
profiles the model, probes the machine, searches and saves; every rank gets the plan or the
same error; and a training loop's re-plans (out of memory, a longer batch) go through it too.

- ``session``: PlanningSession, the sequence and the re-plans; PlanningSteps, how an adapter
  does each step;
- ``ranks``: the ranks that run one plan, their decider, and sharing its plan or error;
- ``plan_file``: a saved plan checked against the run;
- ``profiling``: the first batch profiled (cached; halved on running out of memory);
- ``machine``: the hardware a plan is priced on (SSD tier, links, host share).
"""
from .ranks import PlanFailure, PlanRanks, share_decision
from .session import Decision, PlanningSession, PlanningSteps

__all__ = ["Decision", "PlanFailure", "PlanRanks", "PlanningSession", "PlanningSteps", "share_decision"]
