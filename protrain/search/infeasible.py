"""InfeasibleError - no plan fits, with what would - and the refusal of budgets no plan can
meet, made from the parameter counts alone before the model is profiled. The diagnosis of a
search that found nothing (what to change) is search.diagnosis."""
from __future__ import annotations

from typing import Callable

from ..config import PlannerConfig
from ..cost.memory import state_bytes
from ..units import fmt_bytes


class InfeasibleError(RuntimeError):
    """No plan fits. The message says what would fit and what to change. ``message`` may be
    a function giving it: a part of it costs a search (the plan without the user's pins), and
    the searches around this one try many variants whose errors are never shown - it is
    written the first time it is read (``str``), once."""

    def __init__(self, message: str | Callable[[], str], *, device_needed: int | None = None,
                 host_needed: int | None = None, micro_batch_fit: int | None = None,
                 seq_len_fit: int | None = None, headline: str | None = None):
        self._write = message if callable(message) else None
        self._headline = headline
        super().__init__("" if callable(message) else message)
        self.device_needed = device_needed
        self.host_needed = host_needed
        self.micro_batch_fit = micro_batch_fit
        self.seq_len_fit = seq_len_fit
        """The sequence length the activations would fit at, scaled linearly from this one's
        (an estimate; ``protrain plan --seq max`` plans its way to the exact one)."""

    @property
    def headline(self) -> str:
        """The message's first clause, for a line among the notes of the searches around this
        one (a variant that does not fit): given where writing the rest costs a search."""
        return self._headline if self._headline is not None else str(self).split(";")[0]

    def __str__(self) -> str:
        if self._write is not None:
            self.args, self._write = (self._write(),), None
        return super().__str__()

    def __reduce__(self):
        # Pickled (sent to another rank) with its message written.
        str(self)
        return super().__reduce__()


def check_budgets(total_params: int, largest_param: int, param_bytes: int,
                  config: PlannerConfig, *, grad_accumulation: bool = False) -> None:
    """Refuse budgets no plan can meet, from the parameter counts alone (before profiling):
    one chunk buffer must hold the largest parameter, and device plus host memory must hold
    the model states. The search makes the exact check once the model is profiled."""
    sb = state_bytes(param_bytes, grad_accumulation)
    margin = 1 + config.memory_margin
    if config.device_memory is not None:
        need = largest_param * param_bytes * margin
        if config.device_memory < need:
            raise InfeasibleError(
                f"device_memory={fmt_bytes(config.device_memory)} cannot hold even the largest "
                f"parameter ({fmt_bytes(largest_param * param_bytes)}, with the {config.memory_margin:.0%} "
                f"margin {fmt_bytes(need)}); raise device_memory or remove the limit",
                device_needed=int(need))
    if config.device_memory is not None and config.host_memory is not None:
        states = total_params * min(sb.host, sb.persistent)
        if config.device_memory / margin + config.host_memory < states:
            raise InfeasibleError(
                f"device_memory={fmt_bytes(config.device_memory)} plus host_memory="
                f"{fmt_bytes(config.host_memory)} cannot hold the model states: "
                f"{total_params / 1e6:.1f} M parameters need at least {fmt_bytes(states)} "
                f"({min(sb.host, sb.persistent)} bytes each); raise the limits",
                host_needed=int(states - config.device_memory / margin))

