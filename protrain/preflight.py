"""Settings checked against the model and the launch before the first batch.

The search refuses impossible pins too, but only at the first forward, after minutes of
profiling, and with the search's words. What the model's structure and the world size
already decide is refused here, at initialize, naming the key, the value, the valid range
and the fix. Every rank computes the same facts from the same model and config, so every
rank refuses (none waits in a collective for a peer that stopped).

A check here only refuses what no batch could make work: where the exact figure needs the
profile (the chunk layout follows the execution order), it uses a bound that holds for any
order, and the search makes the exact check later.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .config import ALL, ConfigError, PlannerConfig
from .sp.degree import SPShape, broken_constraints
from .units import fmt_bytes

_FIX_AUTO = 'or "auto" to let the planner choose'


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFacts:
    """What the planner's settings depend on that is known from the model alone."""

    n_blocks: int
    """Transformer blocks (protrain.profile.blocks.find_blocks)."""
    block_list: str
    """Qualified name of the block list, for messages."""
    trainable_params: int
    """Elements of the trainable parameters (a tied parameter once): what the chunks hold."""
    n_trainable: int
    """Trainable parameter tensors (a chunk holds at least one)."""
    largest_param: int
    """Elements of the largest trainable parameter (a parameter is never split over chunks)."""
    largest_name: str
    """Its name, for messages."""
    param_bytes: int
    """Bytes per element of the trainable parameters."""
    heads: int
    """Query heads per attention (0: unknown, or attention ProTrain cannot split)."""
    kv_heads: int
    """Key/value heads (0: unknown)."""
    attention_note: str
    """Why ``heads`` is 0 although the config names heads (a Hugging Face attention
    implementation other than SDPA), else empty."""
    max_positions: int
    """Longest sequence a learned position table allows (0: no such hard limit known)."""

    @classmethod
    def of(cls, module: nn.Module, blocks: str | None = None, where: str = "protrain") -> "ModelFacts":
        """``blocks``: the block list's name, as the adapter's setting ``<where>.blocks`` gives it."""
        from .profile.blocks import BlockListError, find_blocks
        try:
            name, found = find_blocks(module, blocks, key=f"{where}.blocks")
        except BlockListError as e:
            raise ConfigError(str(e)) from None
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        largest_name, largest = max(named, key=lambda item: item[1].numel(), default=("", None))
        heads, kv, note = _heads(module)
        return cls(n_blocks=len(found), block_list=name,
                   trainable_params=sum(p.numel() for _, p in named), n_trainable=len(named),
                   largest_param=largest.numel() if largest is not None else 0,
                   largest_name=largest_name,
                   param_bytes=largest.element_size() if largest is not None else 4,
                   heads=heads, kv_heads=kv, attention_note=note,
                   max_positions=_max_positions(module))


def check_settings(config: PlannerConfig, facts: ModelFacts, *, world: int, ssd_path: str | None,
                   sp_unsupported: str | None = None, profile_seq_len: int | None = None,
                   max_seq_len: int | str | None = None, model_max: int | None = None,
                   where: str = "protrain", sp_key: str | None = None) -> None:
    """Refuse, with a ConfigError naming the key, every setting of ``config`` (and the
    adapter's ``profile_seq_len`` and ``max_seq_len``; ``model_max``: the longest sequence the
    model's config gives, batch_shape.model_max_seq_len) that this model on ``world`` ranks
    cannot run.
    ``sp_unsupported``: why the runtime cannot split this model's sequences (None: it can);
    ``sp_key``: the setting the sequence-parallel pin came from (default
    ``<where>.sequence_parallel``)."""
    pins = config.pins
    if pins.sequence_parallel is not None:
        _check_degree(pins.sequence_parallel, facts, world, sp_unsupported,
                      sp_key or f"{where}.sequence_parallel")
    _check_block_counts(config, facts, where)
    if pins.n_ssd and not ssd_path:
        raise ConfigError(f"{where}.n_ssd = {pins.n_ssd}: blocks on SSD need {where}.ssd_path (a "
                          f"directory on an NVMe drive); set ssd_path, pin n_ssd to 0, "
                          f"{_FIX_AUTO}")
    if pins.n_nvme and not ssd_path:
        raise ConfigError(f"{where}.n_nvme = {pins.n_nvme}: optimizer states on NVMe need "
                          f"{where}.ssd_path (a directory on an NVMe drive); set ssd_path, pin "
                          f"n_nvme to 0, {_FIX_AUTO}")
    _check_chunk_pins(config, facts, where)
    _check_nvme_pin(config, facts, where)
    if profile_seq_len is not None and facts.max_positions and profile_seq_len > facts.max_positions:
        raise ConfigError(f"{where}.profile_seq_len = {profile_seq_len}: the model's position table "
                          f"holds {facts.max_positions} positions, so no batch is that long; use "
                          f"1 to {facts.max_positions}, or remove it to profile the whole sequence")
    _check_max_seq_len(max_seq_len, profile_seq_len, facts, model_max, where)


def _check_max_seq_len(max_seq_len, profile_seq_len, facts: ModelFacts, model_max, where: str) -> None:
    if max_seq_len == "auto":
        if model_max is None:
            raise ConfigError(f"{where}.max_seq_len = \"auto\": the model's config gives no maximum "
                              f"length (max_position_embeddings, n_positions, block_size); give the "
                              f"longest sequence the job trains on as a number of tokens, or remove "
                              f"it to plan for the batches as they come")
        return
    if max_seq_len is None:
        return
    if facts.max_positions and max_seq_len > facts.max_positions:
        raise ConfigError(f"{where}.max_seq_len = {max_seq_len}: the model's position table holds "
                          f"{facts.max_positions} positions, so no batch is that long; use 1 to "
                          f"{facts.max_positions} (or \"auto\")")
    if profile_seq_len is not None and profile_seq_len > max_seq_len:
        raise ConfigError(f"{where}.profile_seq_len = {profile_seq_len} is longer than "
                          f"{where}.max_seq_len = {max_seq_len}, the longest sequence the job "
                          f"trains on: it profiles the first N tokens of a batch; use 1 to "
                          f"{max_seq_len}, or remove it to profile the whole sequence")


def check_profile_length(profile_seq_len: int | None, seq_len: int | None,
                         where: str = "protrain") -> None:
    """At the first batch, before profiling: ``profile_seq_len`` profiles the first tokens of
    a longer sequence, so it must not exceed the batch's."""
    if profile_seq_len is None:
        return
    if seq_len is None:
        raise ConfigError(f"{where}.profile_seq_len = {profile_seq_len}: the first batch has no "
                          f"[batch, sequence] tensor to shorten; remove the setting")
    if profile_seq_len > seq_len:
        raise ConfigError(f"{where}.profile_seq_len = {profile_seq_len} is longer than the first "
                          f"batch's sequences ({seq_len} tokens): it profiles the first N tokens of "
                          f"a longer sequence and scales up; use 1 to {seq_len}, or remove it to "
                          f"profile the whole sequence")


def check_max_length(max_seq_len: int | str | None, shape, where: str = "protrain") -> None:
    """At the first batch (``shape``: batch_shape.BatchShape, None if unknown): the longest
    sequence means nothing for a batch without one."""
    if max_seq_len is not None and shape is not None and shape.seq_len is None:
        raise ConfigError(f"{where}.max_seq_len = {max_seq_len!r}: the first batch has no sequence "
                          f"dimension (no input_ids or inputs_embeds, no integer (batch, tokens) "
                          f"tensor), so there is no length to plan for; remove the setting")


def max_chunks(facts: ModelFacts, chunk_numel: int) -> int:
    """Most chunks the trainable parameters can fill at ``chunk_numel`` elements each, in any
    execution order: packing starts a chunk only when the next parameter does not fit, so two
    neighbouring chunks hold more than one chunk's capacity (protrain/layout.py), and a chunk
    holds at least one parameter."""
    if facts.trainable_params == 0:
        return 0
    full = -(-facts.trainable_params // chunk_numel)
    return min(facts.n_trainable, 2 * full - 1)


# ---- the checks ------------------------------------------------------------------------------
def _check_degree(p: int, facts: ModelFacts, world: int, unsupported: str | None, key: str) -> None:
    """The world size first (a launch fact), then the model's heads and position_ids; the
    sequence length is not known yet and is checked at the first batch."""
    if p == 1:
        return
    # Heads the config does not name (0) are taken as p: only the world size is checked
    # here, and the profile's heads at the first batch.
    shape = SPShape(world=world, heads=facts.heads or p, kv_heads=facts.kv_heads or p, seq_len=0)
    broken = broken_constraints(p, shape)
    broken += [why for why in (facts.attention_note, unsupported) if why]
    if not broken:
        return
    valid = [d for d in range(1, world + 1) if not broken_constraints(d, shape)]
    if facts.attention_note or unsupported:
        valid = [1]
    raise ConfigError(f"{key} = {p}: " + "; ".join(broken) + f". Valid values for this launch "
                      f"and model: {', '.join(map(str, valid))} ({_FIX_AUTO}; the sequence length "
                      f"must divide too, checked at the first batch)")


def _check_block_counts(config: PlannerConfig, facts: ModelFacts, where: str) -> None:
    pins = config.pins
    given = {k: getattr(pins, k) for k in ("n_checkpoint", "n_swap", "n_ssd", "n_selective")
             if getattr(pins, k) is not None}
    n = facts.n_blocks
    for key, v in given.items():
        if v > n:
            raise ConfigError(f"{where}.{key} = {v}: the model has {n} blocks "
                              f"({facts.block_list}), so it takes 0 to {n}; lower it, "
                              f"{_FIX_AUTO}")
    if sum(given.values()) > n:
        listed = ", ".join(f"{where}.{k} = {v}" for k, v in given.items())
        raise ConfigError(f"{listed} add up to {sum(given.values())}, more than the model's {n} "
                          f"blocks ({facts.block_list}): each block has one mode; "
                          f"lower them so they add up to at most {n}, or set one to \"auto\"")


def _check_chunk_pins(config: PlannerConfig, facts: ModelFacts, where: str) -> None:
    pins = config.pins
    w = facts.param_bytes
    largest = facts.largest_param * w
    if pins.chunk_size is not None and pins.chunk_size < largest:
        raise ConfigError(f"{where}.chunk_size = {pins.chunk_size} ({fmt_bytes(pins.chunk_size)}) is "
                          f"below the model's largest trainable parameter ({facts.largest_name}, "
                          f"{largest} bytes = {fmt_bytes(largest)}), and a parameter is never split "
                          f"over chunks; use at least {largest}, {_FIX_AUTO}")
    for key in ("n_persist", "n_buffer"):
        v = getattr(pins, key)
        if v is None or isinstance(v, str) or facts.trainable_params == 0:
            continue
        caps = _capacities(config, facts)
        most = max(max_chunks(facts, c) for c in caps)
        if v > most:
            sizes = ", ".join(fmt_bytes(c * w) for c in caps)
            also = ', "all" (every chunk on the device)' if key == "n_persist" else ""
            raise ConfigError(f"{where}.{key} = {v}: the model's trainable parameters "
                              f"({fmt_bytes(facts.trainable_params * w)}) fill at most {most} "
                              f"chunk(s) at the chunk sizes the search may use ({sizes}); use 0 to "
                              f"{most}{also}, {_FIX_AUTO}")


def _check_nvme_pin(config: PlannerConfig, facts: ModelFacts, where: str) -> None:
    """``n_nvme`` counts offloaded chunks: none where ``n_persist`` is "all", and at most the
    chunks the parameters can fill less the pinned persistent ones (an upper bound: the
    search, with the exact layout, refuses the rest by name)."""
    n, persist = config.pins.n_nvme, config.pins.n_persist
    if not n or facts.trainable_params == 0:
        return
    if persist == ALL:
        raise ConfigError(f"{where}.n_nvme = {n} with {where}.n_persist = \"all\": optimizer states on "
                          f"NVMe are those of offloaded chunks, and \"all\" keeps every chunk on the "
                          f"device; pin n_nvme to 0, n_persist to a number of chunks, {_FIX_AUTO}")
    caps = _capacities(config, facts)
    chunks = max(max_chunks(facts, c) for c in caps)
    most = max(0, chunks - (persist or 0))
    if n > most:
        sizes = ", ".join(fmt_bytes(c * facts.param_bytes) for c in caps)
        kept = f", {persist} of them kept on the device ({where}.n_persist)" if persist else ""
        raise ConfigError(f"{where}.n_nvme = {n}: optimizer states on NVMe are those of offloaded "
                          f"chunks, and the model's trainable parameters fill at most {chunks} "
                          f"chunk(s) at the chunk sizes the search may use ({sizes}){kept}; use 0 to "
                          f"{most}, {_FIX_AUTO}")


def _capacities(config: PlannerConfig, facts: ModelFacts) -> tuple[int, ...]:
    from .layout import capacities
    if config.pins.chunk_size is not None:
        return (config.pins.chunk_size // facts.param_bytes,)
    return capacities(facts.largest_param, facts.trainable_params, facts.param_bytes,
                      config.chunk_sizes)


# ---- what the model's config says ------------------------------------------------------------
def _config_of(module: nn.Module):
    cfg = getattr(module, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            cfg = get_text()
        except Exception:  # noqa: BLE001 - an unusual config: use it as it is
            pass
    return cfg


def _heads(module: nn.Module) -> tuple[int, int, str]:
    """(query heads, key/value heads, note) from the model's config (Hugging Face names, the
    built-in GPT's); (0, 0, "") when it names none."""
    cfg = _config_of(module)
    if cfg is None:
        return 0, 0, ""
    heads = _first_int(cfg, ("num_attention_heads", "n_head", "num_heads"))
    if not heads:
        return 0, 0, ""
    kv = _first_int(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv")) or (
        1 if getattr(cfg, "multi_query", False) else heads)
    impl = getattr(cfg, "_attn_implementation", None)
    if isinstance(impl, str) and impl not in ("sdpa",):
        return heads, kv, (f"the model's attention is attn_implementation=\"{impl}\", which calls no "
                           f"operator ProTrain can split (load the model with "
                           f"attn_implementation=\"sdpa\")")
    return heads, kv, ""


def _max_positions(module: nn.Module) -> int:
    """A learned position table's size (GPT-2's n_positions, nanoGPT's block_size): a hard
    limit. Rotary models' max_position_embeddings is not one, so it is not read."""
    cfg = _config_of(module)
    return _first_int(cfg, ("n_positions", "block_size")) if cfg is not None else 0


def _first_int(cfg, names) -> int:
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0
