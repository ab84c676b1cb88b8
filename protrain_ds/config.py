"""The ``"protrain"`` section of a DeepSpeed JSON, and what enabling it does to the rest.

DeepSpeed keeps unknown top-level sections without looking at them, so this module is the
only validation the section gets: unknown keys and bad values fail at initialize with the key
named. The memory knobs ProTrain replaces are taken out of the config DeepSpeed sees (and
reported if the user set them); setups that cannot work with ProTrain are refused with the
reason.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protrain.config import KNOB_NAMES, ConfigError, PlannerConfig

SECTION = "protrain"

_OWN_KEYS = {
    "enabled": "turn ProTrain on (true) or off (false)",
    "plan_file": "path: load this plan if it exists (and covers the batches), else save the chosen plan there",
    "profile_cache_dir": "directory where measured model profiles are cached between runs",
    "verbosity": "0 quiet, 1 the plan table at start-up (default), 2 debug details",
    "progress": "show a progress bar while profiling (default true)",
    "accounting": "count device-resident bytes in the runtime (slow; for tests and debugging)",
    "ssd_path": "directory on an NVMe drive for activations the plan puts on SSD (enables the tier)",
    "ssd_verify": "checksum what is read back from the drive: auto (optimizer states on NVMe, default), true (also activations), false",
    "ssd_min_bytes": "tensors smaller than this stay on the device instead of going to SSD",
    "cpu_adam": "CPU Adam kernel for offloaded chunks: auto, native (csrc, GIL-free) or deepspeed",
    "cpu_adam_threads": "OpenMP threads of each rank's CPU Adam: auto (the node's cores split among "
                        "its ranks) or a number",
    "trace_file": "path: record each iteration's measured timeline there (protrain explain --plot --trace)",
    "host_thread": "run CPU Adam on a worker thread even on a CPU device (benchmarks; default: on a GPU)",
    "profile_seq_len": "profile the first N tokens of each sequence and scale the profile to the "
                       "batch's length (linear parts by s, attention by s^2)",
    "max_seq_len": "the longest sequence the job trains on (or \"auto\": the model's own maximum): "
                   "the first forward plans for it, so no longer batch re-plans later",
    "blocks": "qualified name of the ModuleList whose children are the model's blocks, e.g. "
              "\"encoder.layer\" (default: found: a list of repeated blocks, else the top-level "
              "modules that hold parameters)",
    "gather_timeout": "seconds a rank waits for the others in a collective save (state_dict with "
                      "sharded parameters, destroy) before failing with the reason (default: the "
                      "process group's timeout)",
}
_PLANNER_KEYS = {f.name for f in dataclasses.fields(PlannerConfig)} | set(KNOB_NAMES)
_DERIVED = {"grad_accumulation_steps": "gradient_accumulation_steps",
            "cpu_optim_overlap": "gradient_clipping / fp16",
            "cpu_optim_speculative": "gradient_clipping / fp16",
            "gradient_clipping": "gradient_clipping"}

# Memory knobs of DeepSpeed that the plan replaces.
REPLACED_ZERO_KEYS = ("stage", "offload_param", "offload_optimizer", "sub_group_size",
                      "contiguous_gradients", "overlap_comm", "reduce_bucket_size",
                      "allgather_bucket_size", "reduce_scatter", "allgather_partitions",
                      "round_robin_gradients", "elastic_checkpoint", "load_from_fp32_weights")
REPLACED_SECTIONS = ("activation_checkpointing",)


@dataclass(frozen=True, kw_only=True)
class ProTrainDSConfig:
    """The validated ``"protrain"`` section."""

    enabled: bool = False
    """ProTrain drives memory; false leaves DeepSpeed untouched."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Memory limits, margins and knob pins for the search."""
    plan_file: str | None = None
    """Load this plan if the file exists (refused, saying what changed, when it was made for
    other parameters, blocks or dtype; planned again, and saved there, when it was made for
    smaller batches than this run's); otherwise save the chosen plan to it (its directory must
    be writable: checked at initialize). A re-plan for a longer batch saves its plan too."""
    profile_cache_dir: str | None = None
    """Cache measured model profiles here, keyed by the model's code and settings, the batch
    shape, the device and versions (protrain/profile/cache.py). Created if missing; one that
    cannot be written is reported at initialize and not used."""
    verbosity: int = 1
    """0: one summary line; 1: the plan table at start-up; 2: debug details."""
    progress: bool = True
    """Progress bar while profiling."""
    accounting: bool = False
    """Count the runtime's device-resident bytes (CPU tests and debugging; slows training)."""
    ssd_path: str | None = None
    """Directory on an NVMe drive: enables the SSD activation tier (SSDTrain). A per-run
    subdirectory is created there and removed at exit, on errors and on SIGTERM. A relative
    path (as every path here) is made absolute at initialize."""
    ssd_verify: bool | str = "auto"
    """Check what is read back from the drive against checksums taken at the write; a
    mismatch stops training naming the file and offset. "auto": the optimizer states on NVMe
    (n_nvme: they live across steps and checkpoints certify them); true: the SSD tier's
    activations too; false: nothing (docs/nvme-states.md gives the cost)."""
    ssd_min_bytes: int = 2**20
    """Saved tensors (storages) smaller than this stay on the device: their I/O would cost
    more than the memory saved."""
    cpu_adam: str = "auto"
    """The host Adam kernel: "native" (csrc/cpu_adam.cpp: DeepSpeed's SIMD kernel with the GIL
    released and the speculative backup fused; compiled on first use), "deepspeed"
    (DeepSpeedCPUAdam: same bits, holds the GIL), or "auto": native where a GPU computes while
    CPU Adam runs, DeepSpeed's on a CPU "device" (updates run inline there)."""
    cpu_adam_threads: int | None = None
    """OpenMP threads of each rank's CPU Adam kernel (DeepSpeed's or the native one). None
    ("auto"): the node's cores split among its ranks (``protrain.runtime.node``), which the
    cost model prices (each rank at 1/ranks-per-node of the node's rates). Not taken from
    OMP_NUM_THREADS: that sets the training loop's threads, and torchrun sets it to 1 whenever
    a node runs several ranks - a single-threaded CPU Adam. A number replaces the share, e.g.
    where a launcher binds each rank to cores of its own (``--bind_cores_to_rank``)."""
    trace_file: str | None = None
    """Record the measured timeline of each iteration (compute per part, chunk copies, each CPU
    Adam update) to this JSON file, rewritten as each iteration ends
    (runtime/timeline_recorder.py); draw it beside the plan's prediction with
    ``protrain explain PLAN.json --plot out.png --trace FILE``."""
    host_thread: bool | None = None
    """CPU Adam on a worker thread: None (default) where a GPU computes meanwhile; true also on a
    CPU "device" (to measure the overlap on CPU, with torch and the kernel on a core each)."""
    profile_seq_len: int | None = None
    """Profile the first N tokens of the first batch's sequences and scale the profile to the
    full length (protrain.sp.scaling: linear parts by s, attention by s^2): faster at very long
    sequences. None: the whole sequence (halved while it runs out of device memory)."""
    max_seq_len: int | str | None = None
    """The longest sequence (tokens) the job will train on, when it is known before training
    (the tokenizer's truncation length, a curriculum's last stage): the first forward plans
    for it - the first batch is profiled as given and the profile scaled to this length
    (protrain.sp.scaling) - so no later batch re-plans. "auto": the model's own maximum (its
    config's max_position_embeddings, n_positions or block_size). None: plan for the first
    batch; a longer one re-plans before its forward, for the next power of two tokens (capped
    by the model's maximum), so lengths that keep growing re-plan a handful of times."""
    blocks: str | None = None
    """The qualified name of the ModuleList (or Sequential) whose children are the model's
    blocks - the units the plan gives a mode each (keep, checkpoint, swap) and cuts the
    iteration at - e.g. "encoder.layer" (BERT), "model.layers". Its children must run in the
    list's order, each once per forward. Refused at initialize, naming the lists the model
    has, when the name holds no such list. None: ProTrain finds them (protrain.profile.blocks:
    a list of two or more children of one class, else the model's top-level modules that hold
    parameters)."""
    sequence_parallel_key: str = "protrain.sequence_parallel"
    """The setting a pinned sequence-parallel degree came from (DeepSpeed's own
    ``sequence_parallel_size`` pins it too), named when the degree is refused."""
    gather_timeout: float | None = None
    """Seconds a rank waits for the other ranks before a collective that gathers sharded
    parameters (the model's state_dict with several ranks, as every weight save reads it;
    destroy), then fails naming the ranks that never came and what to do (a save called on
    one rank only). None: the default process group's timeout (30 minutes), what the
    collective itself would wait."""

    @classmethod
    def from_ds_config(cls, ds_config: dict | None) -> "ProTrainDSConfig":
        section = (ds_config or {}).get(SECTION)
        if section is None:
            return cls()
        if not isinstance(section, dict):
            raise ConfigError(f"{SECTION} must be an object such as {{\"enabled\": true}}, got {section!r}")
        data = dict(section)
        for key in data:
            if key in _DERIVED:
                raise ConfigError(f"{SECTION}.{key} is derived from DeepSpeed's {_DERIVED[key]}; "
                                  f"remove it from the protrain section")
            if key not in _OWN_KEYS and key not in _PLANNER_KEYS:
                from protrain.config import _unknown_key
                raise ConfigError(_unknown_key(f"{SECTION}.{key}", key,
                                               set(_OWN_KEYS) | _PLANNER_KEYS - set(_DERIVED)))
        enabled = data.pop("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{SECTION}.enabled = {enabled!r}: must be true or false")
        kwargs: dict[str, Any] = {"enabled": enabled}
        for key in ("plan_file", "profile_cache_dir", "ssd_path", "trace_file", "blocks"):
            v = data.pop(key, None)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"{SECTION}.{key} = {v!r}: must be a "
                                  + ("module name such as \"encoder.layer\"" if key == "blocks"
                                     else "path string"))
            # Paths resolved now, against the directory the script was in at initialize: one
            # that changes directory later still means the same files (and its run directory
            # under ssd_path is removed where it was made).
            kwargs[key] = os.path.abspath(v) if v is not None and key != "blocks" else v
        v = data.pop("verbosity", 1)
        if isinstance(v, bool) or v not in (0, 1, 2):
            raise ConfigError(f"{SECTION}.verbosity = {v!r}: must be 0, 1 or 2")
        kwargs["verbosity"] = v
        v = data.pop("cpu_adam", "auto")
        if v not in ("auto", "native", "deepspeed"):
            raise ConfigError(f"{SECTION}.cpu_adam = {v!r}: must be \"auto\", \"native\" or "
                              f"\"deepspeed\"")
        kwargs["cpu_adam"] = v
        v = data.pop("cpu_adam_threads", None)
        if v not in (None, "auto"):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
                raise ConfigError(f"{SECTION}.cpu_adam_threads = {v!r}: must be a whole number of "
                                  f"threads from 1 to 4096, or \"auto\" (the node's cores split "
                                  f"among its ranks)")
            kwargs["cpu_adam_threads"] = v
        v = data.pop("host_thread", None)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{SECTION}.host_thread = {v!r}: must be true, false or null")
        kwargs["host_thread"] = v
        if "ssd_min_bytes" in data:
            from protrain.config import _size
            kwargs["ssd_min_bytes"] = _size(data.pop("ssd_min_bytes"), f"{SECTION}.ssd_min_bytes",
                                            positive=False)
        if data.get("profile_seq_len") is not None:
            v = data.pop("profile_seq_len")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{SECTION}.profile_seq_len = {v!r}: must be a whole number of "
                                  f"tokens >= 1")
            kwargs["profile_seq_len"] = v
        data.pop("profile_seq_len", None)
        v = data.pop("max_seq_len", None)
        if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{SECTION}.max_seq_len = {v!r}: must be a whole number of tokens >= 1 "
                              f"(the longest sequence the job trains on), \"auto\" (the model's "
                              f"own maximum) or null (plan for the batches as they come)")
        kwargs["max_seq_len"] = v
        v = data.pop("gather_timeout", None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{SECTION}.gather_timeout = {v!r}: must be a number of seconds > 0 "
                              f"(or null for the process group's timeout)")
        kwargs["gather_timeout"] = None if v is None else float(v)
        for key in ("progress", "accounting"):
            v = data.pop(key, cls.__dataclass_fields__[key].default)
            if not isinstance(v, bool):
                raise ConfigError(f"{SECTION}.{key} = {v!r}: must be true or false")
            kwargs[key] = v
        v = data.pop("ssd_verify", "auto")
        if not isinstance(v, bool) and v != "auto":
            raise ConfigError(f"{SECTION}.ssd_verify = {v!r}: must be \"auto\" (checksums of the "
                              f"optimizer states on NVMe), true (and of activations) or false")
        kwargs["ssd_verify"] = v
        sp = (ds_config or {}).get("sequence_parallel_size")
        if sp is not None and sp != 1:
            if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
                raise ConfigError(f"sequence_parallel_size = {sp!r}: must be a whole number >= 1")
            mine = data.get("sequence_parallel")
            if mine not in (None, "auto") and mine != sp:
                raise ConfigError(f"sequence_parallel_size = {sp} and {SECTION}.sequence_parallel = "
                                  f"{mine!r} disagree; keep one")
            data["sequence_parallel"] = sp      # DeepSpeed's own setting pins the degree
            kwargs["sequence_parallel_key"] = "sequence_parallel_size"
        kwargs["planner"] = PlannerConfig.from_dict(data, where=SECTION)
        return cls(**kwargs)


def load_ds_config(config: Any) -> dict:
    """A DeepSpeed config given as a dict or a path (JSON or HJSON), as DeepSpeed reads it."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config as ds_load
        return ds_load(str(config))
    raise ConfigError(f"DeepSpeed config must be a dict or a path, got {type(config).__name__}")


def is_enabled(ds_config: dict) -> bool:
    section = ds_config.get(SECTION)
    return isinstance(section, dict) and section.get("enabled") is True


def strip_replaced_knobs(ds_config: dict) -> tuple[dict, list[str]]:
    """The config DeepSpeed should see (ZeRO off, activation checkpointing off: ProTrain's
    chunks and block modes do both), and a line per knob the user had set that the plan now
    decides."""
    cfg = copy.deepcopy(ds_config)
    overridden = []
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization must be an object, got {zero!r}")
    for key, value in zero.items():
        if key == "stage" and value in (0, None):
            continue
        if key in REPLACED_ZERO_KEYS or key.startswith("stage3_"):
            overridden.append(f"zero_optimization.{key}={json.dumps(value)}")
        else:
            overridden.append(f"zero_optimization.{key}={json.dumps(value)} (ignored)")
    cfg["zero_optimization"] = {"stage": 0}
    sp = cfg.pop("sequence_parallel_size", None)
    if sp not in (None, 1):
        overridden.append(f"sequence_parallel_size={json.dumps(sp)} (taken as protrain.sequence_parallel)")
    for key in REPLACED_SECTIONS:
        if key in cfg:
            overridden.append(f"{key}={json.dumps(cfg.pop(key))}")
    _unsynchronized_throughput_timer(cfg, overridden)
    return cfg, overridden


def _unsynchronized_throughput_timer(cfg: dict, overridden: list[str]) -> None:
    """DeepSpeed's throughput timer synchronizes the device at the start of every forward and
    the end of every step (``timers.throughput.synchronized``, default true): the host then
    waits for the whole queue twice per micro-step, and the copies and CPU Adam work the plan
    overlaps with compute cannot run ahead. ProTrain keeps the timer, unsynchronized (its
    samples/s come from host time, as DeepSpeed's docs say is accurate enough in most cases);
    a JSON that asked for synchronized timing is told so."""
    timers = cfg.setdefault("timers", {})
    if not isinstance(timers, dict):
        raise ConfigError(f"timers must be an object, got {timers!r}")
    throughput = timers.setdefault("throughput", {})
    if not isinstance(throughput, dict):
        raise ConfigError(f"timers.throughput must be an object, got {throughput!r}")
    if throughput.get("synchronized") is True:
        overridden.append("timers.throughput.synchronized=true (a device sync twice per micro-step "
                          "would serialise the overlapped copies and CPU Adam; timed on the host)")
    throughput["synchronized"] = False


def refuse_conflicts(ds_config: dict) -> None:
    """Setups that cannot run under ProTrain, refused before anything is built."""
    auto = ds_config.get("autotuning") or {}
    if isinstance(auto, dict) and auto.get("enabled"):
        raise ConfigError("autotuning and protrain both tune memory: DeepSpeed's autotuner "
                          "relaunches the job per trial and does not know ProTrain's knobs. "
                          "Disable one of them (autotuning.enabled=false or protrain.enabled=false)")
    if (ds_config.get("data_parallel_size") or 1) > 1:
        raise ConfigError(f"data_parallel_size={ds_config['data_parallel_size']} with protrain is not "
                          f"supported: ProTrain uses every rank (sequence_parallel sets how many "
                          f"share a sequence)")
    if (ds_config.get("compile") or {}).get("deepcompile"):
        raise ConfigError("compile.deepcompile=true with protrain is not supported: DeepCompile's "
                          "passes partition with ZeRO, ProTrain places parameters itself. Remove "
                          "compile.deepcompile; engine.compile() and torch.compile(model) work, "
                          "ProTrain compiles the blocks")
    if ds_config.get("torch_autocast", {}).get("enabled"):
        raise ConfigError("torch_autocast with protrain is not supported: use the bf16 or fp16 "
                          "section (parameters are kept in the training dtype in chunks)")
