"""Optimizer states across a change of the trainable set, as plain DeepSpeed ZeRO-0 keeps them.

When a script changes ``requires_grad`` between optimizer steps, the engine moves to chunks
built for the new set (engine.py ``_protrain_trainable_changed``). What plain DeepSpeed ZeRO-0
does, measured against it (tests/test_trainable_changes.py):

- at backward every parameter with ``requires_grad`` and no gradient gets a zero one (its
  all-reduce); a frozen one gets none, and the optimizer skips a parameter whose ``.grad`` is
  None: no update, its moments and step count kept (torch's optimizers keep ``state``);
- a parameter unfrozen later is updated only if it is in the optimizer's param groups, its
  moments from where they were (zeros if it never trained);
- DeepSpeed's ``"optimizer": {"type": "Adam(W)"}`` builds FusedAdam (on CPU too), whose step
  count is per param group, not per parameter: each step every parameter of the group is
  updated with the count of the *last* parameter of the group that has a gradient, and only
  that parameter's count advances (fused_adam.py ``state['step'] += 1`` after the loop). So
  a parameter unfrozen later starts with the group's count, not at 1; freezing the group's
  last parameter restarts the count of the whole group from the new last one's (0 if it
  never was last), and unfreezing it resumes its own. torch's Adam/AdamW (``torch_adam``, or
  a torch optimizer passed to initialize) count per parameter.

In bf16 / fp16 plain DeepSpeed ZeRO-0 does otherwise: its wrapper (FP16_Optimizer) steps flat
fp32 copies of the param groups made at initialize, so parameters frozen later go on moving
(zeros for gradients, with momentum) and those frozen at initialize are never updated (measured
on CPU with bf16). ProTrain does not reproduce that: it trains the fp32 way, its counts the
wrapper's (the steps taken).

``TrainableStates`` keeps what the chunks no longer hold (the states of parameters frozen
since, this rank's pieces, until they are unfrozen) and FusedAdam's per-parameter counts, and
builds the states the new layout imports.
"""
from __future__ import annotations

import torch
from torch import nn

from protrain.config import ConfigError
from protrain.runtime.states import Piece, RuntimeState

GROUP, PARAM, FLAT = "group", "param", "flat"
"""Step-count rules: FusedAdam's (one count per param group, its last trained parameter's),
torch's (one per parameter), and that of DeepSpeed's 16-bit wrapper (every parameter the count
of steps taken)."""


def step_rule(client_optimizer, torch_adam: bool, half: bool) -> str:
    """The rule of the optimizer plain DeepSpeed would step: in bf16 / fp16 its wrapper's, which
    steps flat fp32 copies of the param groups built at initialize (FP16_Optimizer: one
    tensor per group, always with a gradient, so the count never restarts); else FusedAdam's
    for the config's Adam and AdamW (``client_optimizer`` None) and for a FusedAdam passed in;
    torch's for ``torch_adam`` and the other optimizers passed in."""
    if half:
        return FLAT
    if client_optimizer is None:
        return PARAM if torch_adam else GROUP
    return GROUP if type(client_optimizer).__name__ == "FusedAdam" else PARAM


class TrainableStates:
    """The optimizer states outside the chunks, and the step counts a new layout starts with."""

    def __init__(self, module: nn.Module, param_groups: list[dict], rule: str):
        self.rule = rule
        self.names = {p: n for n, p in module.named_parameters()}
        self.params = {n: p for p, n in self.names.items()}
        self.groups = [[self.names[p] for p in g["params"] if p in self.names] for g in param_groups]
        self.parked: dict[str, list[Piece]] = {}
        """This rank's pieces of each parameter frozen since it trained (master dropped in fp32:
        the parameter itself holds it)."""
        self.counts: dict[str, int] = {}
        """FusedAdam's ``state['step']`` of each parameter that was a group's last one (others 0)."""

    def held(self) -> set[str]:
        """The parameters the optimizer's param groups hold."""
        return {n for g in self.groups for n in g}

    def group_steps(self, steps: dict[str, int], trainable: set[str]) -> list[int | None]:
        """Each group's step count for the layout of ``trainable`` (None: nothing of it trains),
        given ``steps``, the counts in the chunks now; the group rule's counts are taken from
        them (the last trained parameter of each group holds its group's). Refused where the
        groups would count differently (FusedAdam's single C++ kernel then alternates counts
        within a step, computing beta^t by pow() where the chunks' kernels multiply)."""
        if self.rule == FLAT:
            taken = max(steps.values(), default=0)
            return [taken if any(n in trainable for n in g) else None for g in self.groups]
        if self.rule != GROUP:
            return [None] * len(self.groups)
        counts = dict(self.counts)
        for g in self.groups:
            last = next((n for n in reversed(g) if n in steps), None)
            if last is not None:
                counts[last] = steps[last]
        out = []
        for g in self.groups:
            last = next((n for n in reversed(g) if n in trainable), None)
            out.append(None if last is None else counts.get(last, 0))
        if len({s for s in out if s is not None}) > 1:
            lasts = [next((n for n in reversed(g) if n in trainable), None) for g in self.groups]
            raise ConfigError(
                f"ProTrain: with this trainable set DeepSpeed's FusedAdam would step its param groups "
                f"with different counts ({out}: each group counts with its last trainable parameter, "
                f"{lasts}), which ProTrain cannot reproduce bit for bit. Freeze or unfreeze the "
                f"groups' last parameters together, or set \"torch_adam\": true in the optimizer's "
                f"params (a count per parameter)")
        self.counts = counts
        return out

    def carry(self, state: RuntimeState, steps: dict[str, int], trainable: set[str], *,
              rank0: bool, half: bool) -> RuntimeState:
        """The states the layout for ``trainable`` imports, from ``state`` (the old layout's
        export, this rank's pieces, whose parameters' counts were ``steps``): the pieces of the
        parameters still trained; those parked when they were frozen, their master the
        parameter as it is now (a script may have changed a frozen weight); fresh ones (zero
        moments, on rank 0: the export's pieces of all ranks together cover a parameter once)
        for parameters that never trained; the group rule's counts. Parameters leaving the
        chunks are parked."""
        counts = self.group_steps(steps, trainable)
        group_of = {n: gi for gi, g in enumerate(self.groups) for n in g}
        by_name: dict[str, list[Piece]] = {}
        for p in state.pieces:
            by_name.setdefault(p.name, []).append(p)
        for name in set(steps) - trainable:
            self.parked[name] = [_park(p, half) for p in by_name.get(name, ())]
        pieces = []
        for name in sorted(trainable, key=lambda n: group_of.get(n, -1)):
            if name in steps:
                mine = by_name.get(name, [])
            elif name in self.parked:
                mine = [_unpark(p, self.params[name]) for p in self.parked.pop(name)]
            else:
                mine = [_fresh(name, self.params[name])] if rank0 else []
            count = counts[group_of[name]]
            for p in mine:
                if count is not None:
                    p.step = count
            pieces += mine
        return RuntimeState(pieces=pieces, local=True, adam_chain=state.adam_chain)


    # ---- checkpoints ----------------------------------------------------------------------
    def saved_pieces(self) -> list[Piece]:
        """This rank's parked pieces as a checkpoint stores them (the master filled in)."""
        return [_unpark(p, self.params[p.name]) for pieces in self.parked.values() for p in pieces]

    def restore(self, pieces: dict[str, list[Piece]], parked: list[str], counts: dict[str, int], *,
                rank0: bool, half: bool) -> None:
        """Take a checkpoint's parked states (``pieces``: every rank's, by name; kept whole on
        rank 0, every rank knowing which parameters have one) and FusedAdam's counts."""
        self.parked = {n: [_park(p, half) for p in pieces.get(n, ())] if rank0 else [] for n in parked}
        self.counts = dict(counts)


def _park(p: Piece, half: bool) -> Piece:
    """A piece kept while its parameter is frozen (copies: an exported piece may view the
    old layout's memory or its state file)."""
    master = p.master.clone() if half else None
    return Piece(p.name, p.lo, p.hi, master, p.exp_avg.clone(), p.exp_avg_sq.clone(), p.step)


def _unpark(p: Piece, param: nn.Parameter) -> Piece:
    """A parked piece as the chunks take it back: its master the parameter as it is now,
    unless it is still the parked master's rounding (16-bit)."""
    now = param.detach().reshape(-1)[p.lo:p.hi].cpu()
    master = p.master
    # 16-bit: the fp32 master stands while the weight is still its rounding; a weight the script
    # changed meanwhile is taken as it is (as DeepSpeed's fp32 run, which steps the weight itself).
    if master is None or not torch.equal(master.to(now.dtype), now):
        master = now.float().clone()
    return Piece(p.name, p.lo, p.hi, master, p.exp_avg, p.exp_avg_sq, p.step)


def _fresh(name: str, param: nn.Parameter) -> Piece:
    flat = param.detach().reshape(-1).cpu().float().clone()
    return Piece(name, 0, flat.numel(), flat, torch.zeros_like(flat), torch.zeros_like(flat), 0)
