"""Analytic ModelProfile from a model's shape: plan before a GPU is rented.

An *estimate*, documented as such: FLOPs from the shapes at a fixed share of the device's
published peak, saved activations counted tensor by tensor for the standard pre-norm blocks
(GPT-2: LayerNorm, fused QKV, flash attention, GELU MLP; LLaMA: RMSNorm, GQA, SwiGLU), no
dropout. Memory-bound kernels, allocator effects and framework overheads are not modelled;
the measured profile taken at run time is the source of truth.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from .hardware import HardwareProfile
from .model_profile import HeadProfile, MLPProfile, ModelProfile, ParamRecord, PartProfile

MATMUL_EFFICIENCY = 0.5
"""Share of the published peak FLOP/s that training matmuls reach (typical large-model MFU)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only transformer described by its shapes."""

    name: str
    family: Literal["gpt2", "llama"]
    """gpt2: LayerNorm, learned positions, GELU MLP of 4*hidden, biases, tied head.
    llama: RMSNorm, rotary positions, SwiGLU MLP of ffn_hidden, no biases, GQA."""
    n_layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int = 1024
    micro_batch: int = 1
    kv_heads: int | None = None
    """Key/value heads (GQA); None means as many as heads."""
    ffn_hidden: int | None = None
    """MLP inner size; None means 4*hidden (gpt2) or LLaMA's 8/3*hidden rounded up to 256."""
    tied_embeddings: bool | None = None
    """Head shares the embedding matrix; None means the family's default (gpt2 yes, llama no)."""
    max_positions: int | None = None
    """Learned position table size (gpt2); None means seq_len."""
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden", "heads", "vocab", "seq_len", "micro_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model shape {self.name}: {f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model shape {self.name}: hidden ({self.hidden}) must be divisible by "
                             f"heads ({self.heads})")
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"model shape {self.name}: family must be gpt2 or llama, got {self.family!r}")

    @property
    def kv_dim(self) -> int:
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "gpt2":
            return 4 * self.hidden
        return ((8 * self.hidden // 3 + 255) // 256) * 256

    @property
    def tied(self) -> bool:
        return self.family == "gpt2" if self.tied_embeddings is None else self.tied_embeddings

    def block_params(self) -> list[tuple[str, int]]:
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.family == "gpt2":
            return [("ln_1.weight", h), ("ln_1.bias", h), ("attn.c_attn.weight", 3 * h * h),
                    ("attn.c_attn.bias", 3 * h), ("attn.c_proj.weight", h * h), ("attn.c_proj.bias", h),
                    ("ln_2.weight", h), ("ln_2.bias", h), ("mlp.c_fc.weight", f * h),
                    ("mlp.c_fc.bias", f), ("mlp.c_proj.weight", f * h), ("mlp.c_proj.bias", h)]
        return [("input_layernorm.weight", h), ("self_attn.q_proj.weight", h * h),
                ("self_attn.k_proj.weight", kv * h), ("self_attn.v_proj.weight", kv * h),
                ("self_attn.o_proj.weight", h * h), ("post_attention_layernorm.weight", h),
                ("mlp.gate_proj.weight", f * h), ("mlp.up_proj.weight", f * h),
                ("mlp.down_proj.weight", f * h)]

    def total_params(self) -> int:
        h, v = self.hidden, self.vocab
        n = self.n_layers * sum(x for _, x in self.block_params()) + v * h
        n += (self.max_positions or self.seq_len) * h if self.family == "gpt2" else 0
        n += 2 * h if self.family == "gpt2" else h
        n += 0 if self.tied else v * h
        return n


# Published shapes. (GPT-2 1.5B is GPT-2 XL.)
PRESETS: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("gpt2-small", "gpt2", 12, 768, 12, 50257, max_positions=1024),
    ModelShape("gpt2-1.5b", "gpt2", 48, 1600, 25, 50257, max_positions=1024),
    ModelShape("gpt2-10b", "gpt2", 50, 4096, 32, 50257, max_positions=1024),
    ModelShape("llama2-7b", "llama", 32, 4096, 32, 32000, ffn_hidden=11008),
    ModelShape("llama2-13b", "llama", 40, 5120, 40, 32000, ffn_hidden=13824),
    ModelShape("llama2-70b", "llama", 80, 8192, 64, 32000, kv_heads=8, ffn_hidden=28672),
    ModelShape("llama3-8b", "llama", 32, 4096, 32, 128256, kv_heads=8, ffn_hidden=14336),
]}


def shape_from_hf_config(path: str | Path, *, seq_len: int | None = None,
                         micro_batch: int = 1) -> ModelShape:
    """Read a Hugging Face ``config.json`` (GPT-2 or LLaMA-style keys)."""
    path = Path(path)
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if "n_layer" in cfg:  # GPT-2 style
        return ModelShape(
            name=path.parent.name or path.stem, family="gpt2", n_layers=cfg["n_layer"],
            hidden=cfg["n_embd"], heads=cfg["n_head"], vocab=cfg["vocab_size"],
            seq_len=seq_len or cfg.get("n_positions", 1024), micro_batch=micro_batch,
            ffn_hidden=cfg.get("n_inner"), max_positions=cfg.get("n_positions"),
            tied_embeddings=cfg.get("tie_word_embeddings", True))
    try:
        return ModelShape(
            name=path.parent.name or path.stem, family="llama",
            n_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
            heads=cfg["num_attention_heads"], vocab=cfg["vocab_size"],
            seq_len=seq_len or min(cfg.get("max_position_embeddings", 4096), 4096),
            micro_batch=micro_batch, kv_heads=cfg.get("num_key_value_heads"),
            ffn_hidden=cfg.get("intermediate_size"),
            tied_embeddings=cfg.get("tie_word_embeddings", False))
    except KeyError as e:
        raise ValueError(f"{path}: not a GPT-2 or LLaMA-style config (missing {e.args[0]!r}); "
                         f"give the shape with --layers/--hidden/--heads/--vocab instead") from None


def analytic_profile(shape: ModelShape, hw: HardwareProfile) -> ModelProfile:
    """Estimate the keep-all profile of ``shape`` training on ``hw`` (see module docstring)."""
    if hw.peak_flops <= 0:
        raise ValueError(f"{hw.name} has no published peak FLOP/s; the analytic profile needs one "
                         f"(pick a named machine, or profile the model on the device)")
    a, b, s, h = shape.dtype_bytes, shape.micro_batch, shape.seq_len, shape.hidden
    f, kv, v = shape.ffn, shape.kv_dim, shape.vocab
    sbh = s * b * h * a
    sbf = s * b * f * a
    tokens = b * s
    rate = hw.peak_flops * MATMUL_EFFICIENCY

    # Saved activations per block, tensor by tensor (see module docstring).
    if shape.family == "gpt2":
        # ln_1 in, qkv in, q/k/v (one storage), attn out, proj in, ln_2 in, fc in, gelu in, fc2 in
        saved = 7 * sbh + 2 * sbf + 3 * sbh
        norm_saved = sbh
        bwd_transient = 2 * sbf
    else:
        # 2 RMSNorms (fp32 copy + normalized), qkv in, q, k, v, attn out, o in, gate/up in,
        # silu in, silu out, up out, down in
        saved = 2 * 3 * sbh + sbh + (sbh + 2 * s * b * kv * a) + 2 * sbh + sbh + 4 * sbf
        norm_saved = 3 * sbh
        bwd_transient = 3 * sbf
    matmul_params = sum(n for name, n in shape.block_params() if "weight" in name and "ln" not in name
                        and "norm" not in name)
    attn_fwd = 2 * b * s * s * h / rate               # causal attention: half of 4bs^2h
    block_fwd = 2 * tokens * matmul_params / rate + attn_fwd
    # Selective mode (BlockMode.SELECTIVE) keeps the block input and flash attention's outputs
    # (its output and the fp32 log-sum-exp per head and token).
    sel_saved = sbh + sbh + b * shape.heads * s * 4
    attn_io = 2 * sbh + 2 * s * b * kv * a            # q, output; k, v (GQA: kv_dim wide)
    largest_block_param = max(n for _, n in shape.block_params())

    params = _params_in_order(shape)
    post = shape.n_layers + 1
    prefix = _BLOCKS_PREFIX[shape.family]

    # Walk the keep-all iteration to get absolute live levels (see ModelProfile fields).
    parts: list[PartProfile] = []
    live = 0
    pre_out = sbh
    parts.append(PartProfile("<pre>", "pre", sum(p.numel for p in params if p.parts[0] == 0),
                             fwd_time=0.0, bwd_time=0.0, in_bytes=0, saved_bytes=0,
                             fwd_start=0, fwd_peak=pre_out, bwd_start=0, bwd_peak=0))
    live += pre_out
    block_numel = sum(x for _, x in shape.block_params())
    for i in range(shape.n_layers):
        # The block saves its input (already live at its start) and adds the rest of its saved
        # tensors and its output (sbh); the MLP's widest temporary (sbf) is the transient.
        start = live
        parts.append(PartProfile(f"{prefix}.{i}", "block", block_numel, fwd_time=block_fwd,
                                 bwd_time=2 * block_fwd, in_bytes=sbh, saved_bytes=saved,
                                 fwd_start=start, fwd_peak=start + saved + sbf,
                                 bwd_start=0, bwd_peak=0, attn_fwd_time=attn_fwd,
                                 attn_bwd_time=2 * attn_fwd, attn_io_bytes=attn_io,
                                 sel_saved_bytes=sel_saved))
        live = start + saved
    logits = s * b * v
    post_saved = norm_saved + sbh + logits * 4
    head_flops = 2 * tokens * h * v
    post_fwd_peak = live + post_saved + logits * a + logits * 4
    parts.append(PartProfile("<post>", "post", sum(p.numel for p in params if p.parts[0] == post),
                             fwd_time=head_flops / rate, bwd_time=2 * head_flops / rate,
                             in_bytes=sbh, saved_bytes=post_saved, fwd_start=live,
                             fwd_peak=post_fwd_peak, bwd_start=0, bwd_peak=0))
    # Backward: post starts with everything saved plus the fp32 logits still referenced; each
    # part frees its saved tensors as it goes; gradients of the widest intermediates and one
    # parameter gradient are the transient.
    live_bwd = live + post_saved + logits * 4
    out = []
    for part in reversed(parts):
        if part.kind == "post":
            peak = live_bwd + logits * 4 + logits * a
            nxt = live_bwd - post_saved - logits * 4 + sbh
        elif part.kind == "block":
            peak = live_bwd + bwd_transient + sbh + largest_block_param * a
            nxt = live_bwd - part.saved_bytes
        else:
            peak = live_bwd + v * h * a
            nxt = live_bwd
        out.append(replace(part, bwd_start=live_bwd, bwd_peak=peak))
        live_bwd = nxt
    parts = list(reversed(out))
    # The head and loss over tiles (protrain.runtime.tiled_head): the whole logits' terms
    # above go; a tile's forward holds its logits, their fp32 copy and log_softmax's output,
    # its backward those and the two vocab-wide gradients; the weight's gradient is summed
    # over the tiles in one tensor.
    up = 4 if a != 4 else 0                           # the fp32 copy of 16-bit logits
    head = HeadProfile(
        saved_per_token=-4 * v, fwd_peak_per_token=-(8 + a) * v, fwd_peak_per_tile_token=(a + up + 4) * v,
        bwd_start_per_token=-8 * v, bwd_peak_per_token=-(12 + a) * v,
        bwd_peak_per_tile_token=(a + up + 12 + (a if a != 4 else 0)) * v,
        bwd_time_per_token=2 * h * v / rate, bwd_peak_fixed=v * h * a)
    # The MLPs over tiles (protrain.runtime.tiled_mlp): a block no longer saves the MLP's
    # ffn-wide tensors (its input stays saved) nor makes its widest temporary; the tiles'
    # outputs are joined into one more hidden-wide tensor. A tile's forward holds its
    # ffn-wide temporaries, its backward the recomputed tile's saved tensors and their
    # gradients, with the input's gradient (hidden-wide) and the MLP's weight gradients held
    # throughout: their sums over the tiles (fp32 for 16-bit weights) and one tile's.
    # The MLP's pre-norm runs in the tiles too (its output goes to the MLP alone): the block no
    # longer saves the norm's tensors nor its output, only its input - LayerNorm saved that
    # input already (-1 hidden-wide), RMSNorm an fp32 copy and the normalised input (-3); a
    # tile holds those for its own tokens.
    wide_saved, wide_tile = (2, 2) if shape.family == "gpt2" else (4, 3)
    norm_saved = 1 if shape.family == "gpt2" else 3
    mlp_params = sum(n for name, n in shape.block_params() if name.startswith("mlp."))
    mlp = MLPProfile(
        saved_per_token=-wide_saved * f * a - norm_saved * h * a,
        fwd_peak_per_token=-(wide_saved + 1) * f * a - norm_saved * h * a + h * a,
        fwd_peak_per_tile_token=wide_tile * f * a + (norm_saved + 1) * h * a,
        bwd_peak_per_token=-(bwd_transient // max(sbf, 1)) * f * a + h * a,
        bwd_peak_per_tile_token=(wide_saved + wide_tile) * f * a + 2 * (norm_saved + 1) * h * a,
        bwd_time_per_token=2 * mlp_params / rate, bwd_peak_fixed=mlp_params * (max(a, 4) + a), with_norm=True)
    return ModelProfile(name=shape.name, source="analytic", device="analytic",
                        param_bytes=shape.dtype_bytes, params=tuple(params), parts=tuple(parts),
                        micro_batch=b, seq_len=s, heads=shape.heads,
                        kv_heads=shape.kv_heads or shape.heads, head=head, mlp=mlp)


_BLOCKS_PREFIX = {"gpt2": "transformer.h", "llama": "model.layers"}
"""Where the family's Hugging Face models keep their blocks."""


def _params_in_order(shape: ModelShape) -> list[ParamRecord]:
    """The parameters in execution order, named as the family's Hugging Face models name
    them; part 0 is the embedding (pre), 1..n_layers the blocks, n_layers + 1 the head (post)."""
    h, v, s = shape.hidden, shape.vocab, shape.seq_len
    post = shape.n_layers + 1
    params: list[ParamRecord] = []
    emb = ("transformer.wte.weight" if shape.family == "gpt2" else "model.embed_tokens.weight")
    params.append(ParamRecord(emb, v * h, (0, post) if shape.tied else (0,)))
    if shape.family == "gpt2":
        params.append(ParamRecord("transformer.wpe.weight", (shape.max_positions or s) * h, (0,)))
    prefix = _BLOCKS_PREFIX[shape.family]
    for i in range(shape.n_layers):
        params += [ParamRecord(f"{prefix}.{i}.{n}", x, (i + 1,)) for n, x in shape.block_params()]
    if shape.family == "gpt2":
        params += [ParamRecord("transformer.ln_f.weight", h, (post,)),
                   ParamRecord("transformer.ln_f.bias", h, (post,))]
    else:
        params.append(ParamRecord("model.norm.weight", h, (post,)))
    if not shape.tied:
        params.append(ParamRecord("lm_head.weight", v * h, (post,)))
    return params
