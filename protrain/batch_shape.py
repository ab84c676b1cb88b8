"""The batch shape a plan covers, and the shape to plan for when a batch goes beyond it.

A plan's predictions hold for micro-batches up to the shape it was made for: activations
(and the swap arenas sized from them) grow with the samples and the tokens. Data pipelines
change the shape as they go - Hugging Face collators pad each batch to its longest sample,
curricula lengthen sequences - so a framework adapter checks every batch against the shape
in force and plans again, before the forward, for a batch beyond it. Smaller batches run
under the plan in force.

Re-planning rounds the sequence up to the next power of two (capped by the longest sequence
the model accepts), so a job whose lengths keep growing re-plans a handful of times at most
(log2 of the longest over the first), and a micro-batch up to the configured one.

Not every batch has a sequence: an MLP's (batch, features), a CNN's (batch, channels, H, W).
``batch_dims`` says which dimension is the sequence only where the inputs say so (token ids,
Hugging Face ``input_ids`` / ``inputs_embeds``); otherwise the shape is the batch dimension
alone (``seq_len`` None), and nothing is cut or scaled along dimension 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MODEL_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                     "block_size")
"""Model config attributes that give the longest sequence a model accepts (Hugging Face
configs, and nanoGPT-style ones such as protrain.models.GPTConfig)."""


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Samples per micro-batch, and tokens per sample."""

    micro_batch: int
    seq_len: int | None
    """None: the batch has no sequence dimension (``batch_dims``)."""

    def covers(self, other: "BatchShape") -> bool:
        """Whether a plan made for this shape holds for a batch of ``other``'s."""
        return other.micro_batch <= self.micro_batch and (other.seq_len or 0) <= (self.seq_len or 0)

    def union(self, other: "BatchShape") -> "BatchShape":
        """The smallest shape that covers both."""
        seq = None if self.seq_len is None and other.seq_len is None else \
            max(self.seq_len or 0, other.seq_len or 0)
        return BatchShape(max(self.micro_batch, other.micro_batch), seq)

    def __str__(self) -> str:
        if self.seq_len is None:
            return f"{self.micro_batch} samples"
        return f"{self.micro_batch} x {self.seq_len}"


def batch_dims(args, kwargs) -> tuple[int | None, int | None]:
    """(micro-batch, sequence length) of a forward call's inputs; the sequence is None where
    the inputs have none. A sequence is dimension 1 of Hugging Face ``input_ids`` or
    ``inputs_embeds``, else of the first integer tensor of exactly two dimensions (token ids,
    as the built-in GPT takes them). Floating-point features - (batch, features),
    (batch, channels, H, W) - are no sequence: cutting them along dimension 1 would change
    what the model computes, not how long it runs. The micro-batch is dimension 0 of that
    tensor, else of the first tensor with a dimension; (None, None) without tensors."""
    kwargs = kwargs or {}
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return int(ids.shape[0]), int(ids.shape[1])
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 3:
        return int(embeds.shape[0]), int(embeds.shape[1])
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return int(t.shape[0]), int(t.shape[1])
    for t in tensors:
        if t.dim() >= 1:
            return int(t.shape[0]), None
    return None, None


def model_max_seq_len(module) -> int | None:
    """The longest sequence ``module`` accepts, from its config; None when it does not say."""
    cfg = getattr(module, "config", None)
    for key in MODEL_LENGTH_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def replan_shape(need: BatchShape, *, micro_batch: int | None, model_max: int | None) -> BatchShape:
    """The shape to plan for when a batch of ``need`` goes beyond the plan in force: its
    sequence rounded up to the next power of two, capped by ``model_max`` (never below the
    batch's own: a model that accepts more than its config says gets what it was given), and
    its micro-batch raised to the configured ``micro_batch``. Without a sequence, the
    micro-batch alone."""
    if need.seq_len is None:
        return BatchShape(max(need.micro_batch, micro_batch or 0), None)
    seq = next_power_of_two(need.seq_len)
    if model_max is not None:
        seq = max(min(seq, model_max), need.seq_len)
    return BatchShape(max(need.micro_batch, micro_batch or 0), seq)
