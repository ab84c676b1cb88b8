"""Turning ProTrain on and off, strict config, refusals, reporting, and the Hugging Face Trainer."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from dstrain import TINY, base_config, with_protrain

import deepspeed
from protrain.config import ConfigError
from protrain.models import GPT, synthetic_batch


def init(cfg, model=None):
    model = model or GPT(TINY)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_without_the_key_deepspeed_is_untouched():
    engine, *_ = init(base_config())
    assert type(engine) is deepspeed.DeepSpeedEngine
    engine, *_ = init(with_protrain(base_config()))
    assert type(engine).__name__ == "ProTrainEngine" and isinstance(engine, deepspeed.DeepSpeedEngine)
    engine.destroy()
    cfg = with_protrain(base_config())
    cfg["protrain"]["enabled"] = False
    engine, *_ = init(cfg)
    assert type(engine) is deepspeed.DeepSpeedEngine


def test_the_wrapper_is_installed_at_import_in_a_fresh_interpreter():
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "protrain-autoload.pth").exists():
        pytest.skip("package not installed with pip (start-up hook missing)")
    code = ("import deepspeed; from deepspeed import initialize; import protrain_ds; "
            "print(initialize._protrain_wrapper, deepspeed.initialize is initialize)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.split()[-2:] == ["True", "True"], r.stderr


@pytest.mark.parametrize("section, words", [
    ({"enabled": True, "device_memroy": "1GiB"}, ["protrain.device_memroy", "device_memory"]),
    ({"enabled": True, "host_memory": "-2GB"}, ["protrain.host_memory", "negative"]),
    ({"enabled": True, "device_memory": "1KiB"}, ["impossible memory budget", "largest parameter"]),
    ({"enabled": True, "device_memory": "300KiB", "host_memory": "300KiB"},
     ["cannot hold the model states", "raise the limits"]),
    ({"enabled": "yes"}, ["protrain.enabled", "true or false"]),
    ({"enabled": True, "n_swap": -1}, ["protrain.n_swap", "-1"]),
    ({"enabled": True, "grad_accumulation_steps": 4}, ["derived", "gradient_accumulation_steps"]),
    ({"enabled": True, "verbosity": 5}, ["protrain.verbosity", "0, 1 or 2"]),
    ({"enabled": False, "typo": 1}, ["protrain.typo"]),
    ({"enabled": True, **json.loads('{"device_memory": Infinity}')}, ["protrain.device_memory", "finite"]),
    ({"enabled": True, "pins": "x"}, ["protrain.pins", "mapping"]),
    ({"enabled": True, "gather_timeout": 0}, ["protrain.gather_timeout = 0", "seconds > 0"]),
])
def test_bad_protrain_settings_fail_at_initialize_naming_the_key(section, words):
    cfg = base_config()
    cfg["protrain"] = section
    with pytest.raises(ConfigError) as e:
        init(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


# Issue 25 section 4: values a run cannot use, refused at initialize (they used to pass it and
# fail at the first forward, after profiling, or never). TINY: 4 blocks (transformer.h), 4
# heads, a 64-position table, largest parameter transformer.wte.weight (256 x 64 fp32).
REFUSED_AT_INITIALIZE = [
    # 1 rank: the world size is named first (it used to fail in search() with an internal message)
    ({"sequence_parallel": 3}, ["protrain.sequence_parallel = 3", "world size (1 ranks)",
                                "Valid values for this launch and model: 1", '"auto"']),
    ({"pins": {"sequence_parallel": 2}}, ["protrain.sequence_parallel = 2", "world size (1 ranks)"]),
    ({"n_selective": 99}, ["protrain.n_selective = 99", "4 blocks", "0 to 4", '"auto"']),
    ({"n_swap": 5}, ["protrain.n_swap = 5", "4 blocks (transformer.h)", "0 to 4"]),
    ({"n_checkpoint": 3, "n_swap": 3}, ["protrain.n_checkpoint = 3, protrain.n_swap = 3", "add up to 6",
                                        "at most 4"]),
    ({"n_ssd": 1}, ["protrain.n_ssd = 1", "protrain.ssd_path", "pin n_ssd to 0"]),
    ({"n_nvme": 1}, ["protrain.n_nvme = 1", "protrain.ssd_path", "pin n_nvme to 0"]),
    # issue 38, item 11: n_nvme beyond the offloaded chunks (it used to fail at the first forward)
    ({"n_nvme": 16, "ssd_path": "/nonexistent"}, ["protrain.n_nvme = 16", "offloaded chunks",
                                                  "fill at most 15 chunk(s)", "use 0 to 15", '"auto"']),
    ({"n_nvme": 14, "n_persist": 2, "ssd_path": "/nonexistent"},
     ["protrain.n_nvme = 14", "2 of them kept on the device (protrain.n_persist)", "use 0 to 13"]),
    ({"n_nvme": 1, "n_persist": "all", "ssd_path": "/nonexistent"},
     ['protrain.n_nvme = 1 with protrain.n_persist = "all"', "pin n_nvme to 0"]),
    ({"profile_seq_len": 4096}, ["protrain.profile_seq_len = 4096", "64 positions", "1 to 64",
                                 "remove it"]),
    ({"ssd_min_bytes": 1.5}, ["protrain.ssd_min_bytes", "1.5", "whole number of bytes", "64MiB"]),
    ({"ssd_min_bytes": "0.5"}, ["protrain.ssd_min_bytes", "'0.5'", "whole number of bytes"]),
    ({"device_memory": 1.5e9 + 0.5}, ["protrain.device_memory", "whole number of bytes"]),
    ({"chunk_size": 1000}, ["protrain.chunk_size = 1000", "transformer.wte.weight", "65536 bytes",
                            "use at least 65536"]),
    ({"n_persist": 99}, ["protrain.n_persist = 99", "fill at most 15 chunk(s)", "use 0 to 15",
                         '"all"']),
    ({"n_persist": 2, "chunk_size": "1MiB"}, ["protrain.n_persist = 2", "at most 1 chunk(s)",
                                              "(1.0 MiB)"]),
    ({"n_buffer": 40}, ["protrain.n_buffer = 40", "use 0 to 15"]),
    ({"trace_file": "/proc/no/such/trace.json"}, ["protrain.trace_file /proc/no/such/trace.json",
                                                  "writable directory"]),
    ({"max_seq_len": 128}, ["protrain.max_seq_len = 128", "64 positions", "use 1 to 64"]),
    ({"max_seq_len": 32, "profile_seq_len": 48}, ["protrain.profile_seq_len = 48 is longer than "
                                                  "protrain.max_seq_len = 32", "use 1 to 32"]),
]


@pytest.mark.parametrize("section, words", REFUSED_AT_INITIALIZE)
def test_values_a_run_cannot_use_are_refused_at_initialize(section, words):
    cfg = with_protrain(base_config(), **section)
    with pytest.raises(ConfigError) as e:
        init(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_deepspeeds_sequence_parallel_size_is_named_when_refused():
    cfg = with_protrain(base_config(sequence_parallel_size=2))
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size = 2: P must divide the world size"):
        init(cfg)


def test_pins_at_their_limits_are_accepted():
    """The bounds refuse only what no layout can run: the limits themselves pass initialize."""
    for section in ({"n_selective": 4}, {"n_checkpoint": 2, "n_swap": 2}, {"chunk_size": 65536},
                    {"n_persist": "all"}, {"profile_seq_len": 64}, {"ssd_min_bytes": "1.5KiB"},
                    {"sequence_parallel": 1}, {"max_seq_len": 64, "profile_seq_len": 64},
                    {"max_seq_len": "auto"}):
        engine, *_ = init(with_protrain(base_config(), **section))
        engine.destroy()


def test_profile_seq_len_longer_than_the_batch_is_refused_before_profiling():
    """A model without a position table (rotary): only the first batch tells its length."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2))
    engine, *_ = init(with_protrain(base_config(), profile_seq_len=32), model)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(ConfigError) as e:
        engine(input_ids=ids, labels=ids)
    msg = str(e.value)
    assert "protrain.profile_seq_len = 32" in msg and "(16 tokens)" in msg and "use 1 to 16" in msg, msg
    assert calls == []                      # refused before the profiler ran the model
    engine.destroy()


@pytest.mark.parametrize("extra, words", [
    ({"autotuning": {"enabled": True}}, ["autotuning", "protrain.enabled=false"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, ["optimizer.params.momentum"]),
])
def test_setups_that_cannot_work_are_refused_with_the_reason(extra, words):
    with pytest.raises(ConfigError) as e:
        init(with_protrain(base_config(**extra)))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_parameters_partitioned_behind_the_engine_are_refused_and_pipeline_models_step_aside(capsys):
    """A model built under zero.Init before initialize is made whole (test_ds_surface.py); one
    partitioned after it, behind the engine, is refused at the first forward. A PipelineModule
    goes to DeepSpeed's pipeline engine, saying so (was refused)."""
    from protrain.models import synthetic_batch
    model = GPT(TINY)
    engine, *_ = init(with_protrain(base_config()), model)
    for p in model.parameters():
        p.ds_id = 0                        # what zero.Init leaves on parameters
    with pytest.raises(ConfigError, match="after deepspeed.initialize"):
        engine(*synthetic_batch(TINY, 2, seed=0))
    engine.destroy()
    from deepspeed.pipe import LayerSpec, PipelineModule
    deepspeed.init_distributed()
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4)], num_stages=1)
    from deepspeed.runtime.pipe.engine import PipelineEngine
    capsys.readouterr()
    engine, *_ = init(with_protrain(base_config(), verbosity=1), pipe)
    assert isinstance(engine, PipelineEngine)
    out = capsys.readouterr().out
    assert "a PipelineModule" in out and "ProTrain steps aside" in out, out


def test_unusable_plan_file_and_profile_cache_are_reported_at_initialize(tmp_path, monkeypatch, caplog):
    """Not after profiling at the first forward with a raw OSError: a plan file that cannot be
    saved is refused naming the key; a cache directory that cannot be written is reported
    and not used (training goes on, profiling every time)."""
    import errno
    import tempfile
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):    # a read-only mount (root ignores permission bits)
        if dir is not None and Path(dir) == readonly:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkstemp(*args, dir=dir, **kwargs)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    for plan_file, words in [(readonly / "plan.json", "Read-only file system"),
                             (a_file / "plan.json", "exists and is not a directory"),
                             (tmp_path, "is a directory")]:
        with pytest.raises(ConfigError) as e:
            init(with_protrain(base_config(), plan_file=str(plan_file)))
        assert f"protrain.plan_file {plan_file}" in str(e.value) and words in str(e.value), str(e.value)
    for cache, words in [(a_file, "exists and is not a directory"), (readonly, "Read-only file system")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="protrain"):
            engine, *_ = init(with_protrain(base_config(), profile_cache_dir=str(cache)))
        assert f"protrain.profile_cache_dir {cache} cannot be used" in caplog.text, caplog.text
        assert words in caplog.text and "not be cached" in caplog.text
        if cache == a_file:
            x, y = synthetic_batch(TINY, 2)
            engine.backward(engine(x, y))      # profiles without the cache
            engine.step()
        engine.destroy()
    assert a_file.read_text() == "x" and list(readonly.iterdir()) == []


def test_replaced_knobs_are_reported(capsys):
    extra = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu"},
                                   "stage3_max_live_parameters": 1e9},
             "activation_checkpointing": {"partition_activations": True}}
    cfg = with_protrain(base_config(**extra), verbosity=1)
    engine, *_ = init(cfg)
    out = capsys.readouterr().out
    for knob in ("zero_optimization.stage=3", "zero_optimization.offload_param",
                 "zero_optimization.offload_optimizer", "stage3_max_live_parameters",
                 "activation_checkpointing"):
        assert knob in out, out
    x, y = synthetic_batch(TINY, 2)
    engine.backward(engine(x, y))
    engine.step()
    out = capsys.readouterr().out
    assert "ProTrain plan for" in out and "profiling took" in out
    engine.destroy()


def test_hugging_face_trainer_trains_with_the_protrain_key(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i % 4))
            return {"input_ids": ids, "labels": ids}

    ds_cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "train_batch_size": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                         "betas": "auto", "eps": "auto"}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "protrain": {"enabled": True, "device_memory": "1GiB", "progress": False}}
    (tmp_path / "ds.json").write_text(json.dumps(ds_cfg))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=4,
        logging_steps=1, learning_rate=3e-3, report_to="none", save_strategy="no",
        deepspeed=str(tmp_path / "ds.json"), use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "ProTrainEngine"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3     # it learns
    trainer.model_wrapped.destroy()


def test_max_seq_len_auto_without_a_maximum_in_the_model_config_is_refused_at_initialize():
    class NoConfig(torch.nn.Module):           # the built-in GPT, its config hidden
        def __init__(self):
            super().__init__()
            self.gpt = GPT(TINY)

        def forward(self, x, y=None):
            return self.gpt(x, y)
    cfg = with_protrain(base_config(), max_seq_len="auto")
    with pytest.raises(ConfigError, match=r'protrain.max_seq_len = "auto": the model\'s config gives no '
                                          r'maximum length.*as a number of tokens'):
        init(cfg, NoConfig())


def test_the_allocator_choice_is_made_before_deepspeed_allocates_and_printed(monkeypatch, capsys):
    """protrain/allocator.py's choice runs in the engine's start-up, before DeepSpeed's own
    __init__ touches the device, and its line is printed with the plan's start-up lines."""
    from protrain_ds import engine as engine_mod
    order = []
    monkeypatch.setattr(engine_mod, "choose_allocator",
                        lambda: order.append("allocator") or "ProTrain: CUDA allocator (test line)")
    import functools
    init_ds = deepspeed.DeepSpeedEngine.__init__

    @functools.wraps(init_ds)            # the contract check reads the signature
    def ds_init(self, *a, **k):
        order.append("deepspeed")
        init_ds(self, *a, **k)
    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "__init__", ds_init)
    engine, *_ = init(with_protrain(base_config(), verbosity=1))
    assert order == ["allocator", "deepspeed"]
    assert "ProTrain: CUDA allocator (test line)" in capsys.readouterr().out
    engine.destroy()
