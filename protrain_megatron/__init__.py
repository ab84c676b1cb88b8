"""ProTrain for Megatron: per-layer activation policies planned from a profile of the model.

Megatron keeps its own model states (parameters, gradients, distributed optimizer); what it
leaves to hand-tuning is activation memory: ``--recompute-granularity / -method / -num-layers``
and CPU offloading. This package plans those per layer with ProTrain's planner (keep,
checkpoint, swap to host, NVMe) and applies the plan:

- through Megatron's own config where Megatron can express it (no recompute, or recompute of
  the first N layers: ``recompute_granularity="full"``, ``recompute_method="block"``);
- through hooks on ``TransformerBlock.layers`` otherwise (swap, NVMe, mixed per-layer modes).

Entries:
- ``plan_activations(model, sample)``: megatron-core users with their own training loop;
- ``--protrain-auto-memory``: Megatron-LM's ``pretrain()``, wired by the start-up hook
  (``protrain_megatron.training``).
"""
from protrain.requires import require

require("megatron")     # megatron-core, or Megatron-LM's source tree with megatron/core

from .apply import ActivationPolicy, AppliedPlan, plan_activations  # noqa: E402
from .state_bytes import MegatronStates  # noqa: E402

__all__ = ["ActivationPolicy", "AppliedPlan", "MegatronStates", "plan_activations"]
