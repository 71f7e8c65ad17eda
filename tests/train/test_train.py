"""`zeroshard train`: configuration, the loss curve across stages and N, the command."""

import json
import os
import signal
import tempfile
import warnings
from pathlib import Path

import pytest

from zeroshard.cli import build_parser, main
from zeroshard.commands.train import config_of as _config
from zeroshard.runtime.spawn import spawn
from zeroshard.spec.config import ZeroConfig
from zeroshard.train import early
from zeroshard.train.loop import train
from zeroshard.train.settings import TrainConfig, engine_keys, from_deepspeed, resolve

pytestmark = pytest.mark.dist


def _curves(cases):
    return {key: train(TrainConfig(**kw))["losses"] for key, kw in cases.items()}


def _grid(world):
    base = dict(model="tiny", steps=6, batch=8, eval_every=100, eval_batches=1, sample_chars=0)
    cases = {("fp32", s): dict(base, zero=ZeroConfig(stage=s)) for s in range(4)}
    if world == 2:
        cases[("accum", 2)] = dict(base, zero=ZeroConfig(stage=2), micro_batch=2)
        cases[("accum", 0)] = dict(base, zero=ZeroConfig(stage=0), micro_batch=2)
    return cases


@pytest.fixture(scope="module")
def curves():
    return {w: spawn(_curves, w, _grid(w), timeout=300)[0] for w in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stages_give_the_same_curve(curves, world):
    c = curves[world]
    assert c[("fp32", 0)] == c[("fp32", 1)] == c[("fp32", 2)] == c[("fp32", 3)]
    assert c[("fp32", 0)][-1] < c[("fp32", 0)][0]


@pytest.mark.parametrize("world", [2, 4])
def test_curve_does_not_depend_on_n(curves, world):
    for a, b in zip(curves[1][("fp32", 3)], curves[world][("fp32", 3)]):
        assert abs(a - b) < 1e-5


def test_accumulation_follows_the_same_curve(curves):
    for a, b in zip(curves[2][("fp32", 0)], curves[2][("accum", 2)]):
        assert abs(a - b) < 1e-5
    for a, b in zip(curves[2][("accum", 0)], curves[2][("accum", 2)]):
        assert abs(a - b) < 1e-5


def _one_step(stage):
    return train(TrainConfig(model="tiny", zero=ZeroConfig(stage=stage), steps=1, batch=8,
                             eval_every=100, eval_batches=1, sample_chars=0))["memory"]


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_summary_of_a_single_step(stage):
    """The summary reads gradients before the step and the optimizer's state after it,
    so a run of one step (whose step creates Adam's state) shows both as planned."""
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ParallelDims, ZeroConfig, model_state_bytes

    mem = spawn(_one_step, 2, stage, timeout=300)[0]
    params = sum(p.numel() for p in GPT(get_preset("tiny")).parameters())
    weights, grads, optimizer = model_state_bytes(params, ParallelDims(2), ZeroConfig(stage))
    assert (mem["grads"], mem["optimizer"]) == (grads, optimizer)


def test_the_command_trains_and_logs(tmp_path, capsys, monkeypatch):
    log = tmp_path / "log.jsonl"
    handed = []  # what the command's handover to the early launcher returned
    take = early.take
    monkeypatch.setattr(early, "take", lambda *a: handed.append(take(*a)) or handed[-1])
    code = main(["train", "--nproc", "2", "--model", "tiny", "--steps", "30", "--eval-every",
                 "15", "--lr", "1e-2", "--json-log", str(log), "--sample-chars", "20"])
    assert code == 0
    assert len(handed) == 1 and handed[0].returncode == 0  # run by the launcher started early
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"loss", "lr", "tokens_per_s", "grad_norm"} <= rows[0].keys()
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert evals[-1]["val_loss"] < 5.0 < rows[0]["loss"]


def test_deepspeed_config_keys():
    ds = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                                "stage3_prefetch_bucket_size": 5e7,
                                "stage3_param_persistence_threshold": 1e4},
          "bf16": {"enabled": True},
          "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW"}}
    with pytest.warns(UserWarning, match="ignored by zeroshard: "
                                         "zero_optimization.overlap_comm$"):
        out = from_deepspeed(ds, nproc=2)
    assert out == {"zero": ZeroConfig(stage=2, mixed_precision="bf16",
                                      param_persistence_threshold=10000,
                                      reduce_bucket_size=500_000_000,
                                      prefetch_bucket_size=50_000_000),
                   "optimizer": "adamw", "weight_decay": 0.0,  # DeepSpeed's Adam's default
                   "clip": 0.5, "batch": 16, "micro_batch": 2}
    assert TrainConfig(**out).accumulation(2) == (2, 4)


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not a ZeRO stage"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes' must be true or false"),
    ({"train_batch_size": -8}, "train_batch_size=-8 must be a positive integer"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}},
     "zero_optimization.reduce_bucket_size='big' must be an integer >= 0"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 2.5}},
     "zero_optimization.stage3_prefetch_bucket_size=2.5 must be an integer >= 0"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, "train_batch_size=16 != train_micro_batch_size_per_gpu=2"),
])
def test_bad_deepspeed_values_name_key_and_value(ds, message):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=message.replace("(", r"\(")):
        warnings.simplefilter("ignore")
        from_deepspeed(ds, nproc=2)


def test_config_file_flags_win(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"stage": 1, "steps": 7, "lr": 0.5}))
    cfg = resolve({"steps": 9}, str(path))
    assert (cfg.zero.stage, cfg.steps, cfg.lr) == (1, 9, 0.5)
    path.write_text(json.dumps({"stages": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['stages'\]"):
        resolve({}, str(path))


@pytest.mark.parametrize("argv,message", [
    (["--batch", "7", "--nproc", "2"], "--batch=7 does not divide over 2 processes"),
    (["--micro-batch", "3"], "--micro-batch=3 does not divide the 8 sequences"),
    (["--model", "huge"], "--model='huge'; expected one of tiny, small, medium"),
    (["--model", "tiny", "--hf-model", "/nonexistent"],
     "--model='tiny' is a built-in GPT preset and --hf-model='/nonexistent' a model folder: "
     "give one of them"),
    (["--steps", "0"], "--steps=0 must be a positive number"),
    (["--resume", "/nonexistent"], "/nonexistent: no such checkpoint folder"),
    (["--init-from", "/nonexistent"], "--init-from='/nonexistent': no such file"),
    (["--stage", "5"], "error: --stage=5 is not a ZeRO stage; expected 0, 1, 2 or 3"),
    (["--mixed-precision", "fp8"], "--mixed-precision='fp8' is not supported; expected None, "
                                   "'fp32', 'bf16' or a recipe name (bf16-mixed-adamw, "),
    (["--precision", "fp8"], "--mixed-precision='fp8' is not supported"),
    (["--reduce-dtype", "fp16"], "--reduce-dtype='fp16'; expected 'fp32' or 'bf16'"),
    (["--units", "layers"], "--units='layers'; expected 'blocks', 'model' or a parameter "
                            "count"),
    (["--units", "0"], "--units=0 must be a positive parameter count"),
    (["--prefetch", "-1"], "--prefetch=-1 must be an integer >= 0"),
    (["--reduce-bucket-size", "-5"], "--reduce-bucket-size=-5 must be an integer >= 0"),
])
def test_bad_flags_fail_before_launch(argv, message, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err  # one line, no traceback or usage dump


def _early_launchers() -> list[int]:
    """This process's children that are launchers started early (``train/early.py``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and early.WAIT_FLAG.encode() in cmd:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_command_that_ends_before_launching_leaves_no_launcher(capsys):
    assert main(["train", "--steps", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    capsys.readouterr()
    assert _early_launchers() == []


def test_the_early_launcher_ignores_ctrl_c_until_handed_its_run_and_ends_quietly(capfd):
    """Started with SIGINT ignored: a Ctrl-C before the handover leaves it to the command
    (which kills it); given no run (end of input), it exits 0 and says nothing."""
    early.start([])
    (proc, pipe), early._started = early._started, None
    try:
        proc.send_signal(signal.SIGINT)  # while it imports torch: a traceback if not ignored
        pipe.close()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    out = capfd.readouterr()
    assert out.out == out.err == "", out


def _parse(*argv):
    return _config(build_parser("train").parse_args(["train", *argv]))


#: A value other than the default for every engine field, as a flag and as the field.
ENGINE_FLAGS = {
    "stage": (["--stage", "1"], 1),
    "mixed_precision": (["--mixed-precision", "bf16"], "bf16"),
    "reduce_dtype": (["--reduce-dtype", "bf16"], "bf16"),
    "units": (["--units", "60000"], 60000),
    "param_persistence_threshold": (["--param-persistence-threshold", "100"], 100),
    "prefetch": (["--prefetch", "2"], 2),
    "prefetch_bucket_size": (["--prefetch-bucket-size", "1000"], 1000),
    "reduce_bucket_size": (["--reduce-bucket-size", "5000"], 5000),
    "sync_module_states": (["--no-sync-module-states"], False),
    "broadcast_buffers": (["--no-broadcast-buffers"], False),
    "check_collectives": (["--no-check-collectives"], False),
    "nonfinite": (["--nonfinite", "raise"], "raise"),
    "generate_gather": (["--generate-gather", "unit"], "unit"),
    "activation_checkpointing": (["--activation-checkpointing", "2"], 2),
    "shard_group": (["--shard-group", "2"], 2),
    "secondary_group": (["--secondary-group", "1"], 1),
    "quantize_weights": (["--quantize-weights"], True),
    "quantize_grads": (["--quantize-grads"], True),
    "quant_block": (["--quant-block", "256"], 256),
    "offload": (["--offload", "optimizer"], "optimizer"),
    "offload_dir": (["--offload", "optimizer", "--offload-dir", tempfile.gettempdir()],
                    tempfile.gettempdir()),
    "sub_group_size": (["--sub-group-size", "1000"], 1000),
}


def test_every_engine_field_has_a_flag_that_reaches_zero_config():
    assert set(ENGINE_FLAGS) == set(engine_keys())  # a new engine field needs a case here
    default = TrainConfig().zero
    for name, (argv, value) in ENGINE_FLAGS.items():
        assert getattr(default, name) != value, name
        assert getattr(_parse(*argv).zero, name) == value, name
    # all at once, but for stage 3's hpZ and qwZ (the stage case is another stage) and
    # qgZ (the reduce_dtype case asks for another reduction)
    apart = ("secondary_group", "quantize_weights", "quantize_grads")
    together = {k: v for k, v in ENGINE_FLAGS.items() if k not in apart}
    cfg = _parse(*(a for argv, _ in together.values() for a in argv), "--profile", "p")
    assert cfg.zero == ZeroConfig(**{k: v for k, (_, v) in together.items()}, profile=True)
    # the ranks rebuild the settings from JSON: nothing is lost on the way
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert _parse("--units", "model").zero.units is None
    assert _parse("--sync-module-states").zero.sync_module_states is True
    # no flag: the engine's defaults, but a non-finite step is skipped and counted
    assert _parse().zero == ZeroConfig(nonfinite="skip")


def test_precision_is_an_alias_of_mixed_precision(capsys):
    assert _parse("--precision", "bf16").zero.mixed_precision == "bf16"
    assert _parse("--precision", "bf16", "--mixed-precision", "fp32").zero.mixed_precision \
        == "fp32"  # one setting: the last flag given wins
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--precision {fp32,bf16,RECIPE}\n                        alias of " \
           "--mixed-precision" in capsys.readouterr().out


def test_deepspeed_config_goes_through_the_engines_translator(tmp_path, monkeypatch, recwarn):
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True},
          "bf16": {"enabled": True}, "fp16": {"enabled": False}, "train_batch_size": 32,
          "gradient_clipping": 0.0, "scheduler": {"type": "WarmupLR"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    calls = []
    engine_translator = ZeroConfig.from_deepspeed.__func__
    monkeypatch.setattr(ZeroConfig, "from_deepspeed", classmethod(
        lambda cls, d, handled=(): calls.append(d) or engine_translator(cls, d, handled)))
    cfg = _parse("--config", str(path), "--reduce-bucket-size", "7")
    assert calls == [ds]  # one translator, the engine's
    assert cfg.zero == ZeroConfig(stage=2, mixed_precision="bf16", reduce_bucket_size=7,
                                  nonfinite="skip")  # the trainer's default
    assert (cfg.batch, cfg.clip) == (32, None)  # the trainer's keys, on top
    assert (cfg.schedule, cfg.warmup, cfg.warmup_type) == ("constant", 1000, "log")
    (warning,) = recwarn.list  # one warning names every key neither honours
    assert str(warning.message) == ("DeepSpeed config keys ignored by zeroshard: "
                                    "zero_optimization.overlap_comm")


def test_engine_keys_flat_or_nested_under_zero(tmp_path):
    path = tmp_path / "c.json"
    engine = {"stage": 1, "mixed_precision": "bf16", "units": "model", "prefetch": 0,
              "sync_module_states": False}
    path.write_text(json.dumps({"steps": 7, "zero": engine}))
    nested = resolve({}, str(path))
    path.write_text(json.dumps({"steps": 7, **engine}))
    assert resolve({}, str(path)) == nested
    assert nested.steps == 7
    assert nested.zero == ZeroConfig(stage=1, mixed_precision="bf16", units=None, prefetch=0,
                                     sync_module_states=False, nonfinite="skip")
    path.write_text(json.dumps({"zero": {"stage": 1}}))
    assert resolve({"stage": 2, "mixed_precision": "bf16"}, str(path)).zero == ZeroConfig(
        stage=2, mixed_precision="bf16", nonfinite="skip")  # flags win over the file
    path.write_text(json.dumps({"precision": "bf16"}))  # the trainer's earlier key
    assert resolve({}, str(path)).zero.mixed_precision == "bf16"


@pytest.mark.parametrize("data,message", [
    ({"zero": {"stages": 1}}, r"unknown keys \['zero.stages'\]; expected some of \['nproc', "),
    ({"zero": {"stages": 1}}, r"the engine's \['stage', 'mixed_precision', 'reduce_dtype', "),
    ({"stage": 1, "zero": {"stage": 2}}, "stage is given twice"),
    ({"precision": "bf16", "mixed_precision": "fp32"}, "mixed_precision is given twice"),
    ({"zero": {"profile": True}}, "zero.profile follows the trainer's profile, a directory"),
    ({"zero": 3}, "zero=3 must be a JSON object of engine keys"),
    ({"zero": {"stage": 7}}, "stage=7 is not a ZeRO stage; expected 0, 1, 2 or 3"),
    ({"zero": {"units": "layers"}}, "units='layers'; expected 'blocks', 'model' or a "),
    ({"save_dir": 5}, r"save_dir=5 must be a string or null"),
    ({"seed": "x"}, r"seed='x' must be an integer"),
    ({"steps": 2.5}, r"steps=2.5 must be an integer"),
    ({"lr": "fast"}, r"lr='fast' must be a number"),
    ({"clip": True}, r"clip=True must be a number or null"),
    ({"param_persistence_threshold": "abc"},
     r"param_persistence_threshold='abc' must be an integer >= 0"),
])
def test_bad_config_files_name_key_and_accepted_values(tmp_path, data, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        resolve({}, str(path))


def _diverge():
    """A learning rate no run survives: every step after the first is non-finite."""
    try:
        train(TrainConfig(model="tiny", steps=20, batch=4, lr=1e30, warmup=1, clip=None,
                          eval_every=100, eval_batches=1, sample_chars=0, max_skipped=3))
    except FloatingPointError as exc:
        return str(exc)
    return "finished"


def test_a_diverged_run_skips_then_stops_with_a_clear_error(capfd):
    msgs = spawn(_diverge, 2, timeout=120)
    assert msgs[0] == msgs[1]
    assert "3 steps in a row (to step " in msgs[0] and "max_skipped=3" in msgs[0], msgs
    out = " ".join(capfd.readouterr().out.split())
    assert "step 2 skipped (non-finite gradients): 1 in a row, 1 in all;" in out, out
    assert "step 4 skipped (non-finite gradients): 3 in a row, 3 in all; the run stops at 3 " \
           "in a row" in out, out


def _fp16():
    return train(TrainConfig(model="tiny", steps=8, batch=8, lr=1e-2, eval_every=100,
                             eval_batches=1, sample_chars=0,
                             zero=ZeroConfig(stage=2, mixed_precision="fp16")))["losses"]


def _fp16_deepspeed(save_dir):
    """A DeepSpeed config's fp16 block through the trainer: 8 good steps with a window of
    2 grow the scale by DeepSpeed's rule (at steps 3, 5 and 7: the first growth one step
    after torch's) from 2^10 to 2^13; torch's rule would reach 2^14. Then the same run
    saved at step 4 and resumed: the scale and its counters come back with it."""
    kwargs = from_deepspeed({"zero_optimization": {"stage": 2}, "fp16": {
        "enabled": True, "initial_scale_power": 10, "loss_scale_window": 2}}, nproc=2)
    common = dict(model="tiny", batch=8, lr=1e-2, eval_every=100, eval_batches=1,
                  sample_chars=0, **kwargs)
    whole = train(TrainConfig(steps=8, **common))["loss_scale"]
    train(TrainConfig(steps=4, save_dir=save_dir, **common))
    resumed = train(TrainConfig(steps=8, save_dir=save_dir, resume="latest", **common))
    return whole, resumed["loss_scale"]


def test_fp16_trains_with_deepspeeds_loss_scaling(tmp_path):
    assert spawn(_fp16_deepspeed, 2, str(tmp_path), timeout=120) == [(2.0 ** 13,) * 2] * 2


def test_deepspeed_fp16_block_goes_to_the_trainers_scaler(recwarn):
    out = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 3, "auto_cast": False}},
                         nproc=2)
    assert out["loss_scaler"] == {"enabled": True, "hysteresis": 3}
    assert [str(w.message) for w in recwarn.list] == [
        "DeepSpeed config keys ignored by zeroshard: fp16.auto_cast"]
    with pytest.raises(ValueError, match=r"fp16.min_loss_scale=0; expected above 0"):
        from_deepspeed({"fp16": {"enabled": True, "min_loss_scale": 0}}, nproc=2)


def test_fp16_trains_with_dynamic_loss_scaling():
    """--precision fp16: the trainer scales the loss (zs.GradScaler); 8 steps at 2^16
    without an overflow, the loss falling as under fp32."""
    losses = spawn(_fp16, 2, timeout=120)[0]
    assert all(x == x for x in losses) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_the_traffic_table_plans_zeropp(capfd):
    """qwZ and qgZ: the planned row is the planner's quantized bytes, equal to the sent."""
    assert main(["train", "--nproc", "2", "--model", "tiny", "--steps", "2", "--batch", "4",
                 "--eval-every", "100", "--sample-chars", "0", "--quantize-weights",
                 "--quantize-grads"]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip()
            for line in capfd.readouterr().out.splitlines() if line.count("│") == 4}
    assert rows["total"] == rows["planned"] and float(rows["total"]) > 0, rows


def test_engine_flags_reach_the_ranks(capfd):
    assert main(["train", "--nproc", "2", "--model", "tiny", "--steps", "2", "--batch", "4",
                 "--eval-every", "2", "--sample-chars", "0", "--stage", "1", "--precision",
                 "bf16", "--units", "model", "--reduce-bucket-size", "1000"]) == 0
    out = capfd.readouterr().out
    assert "ZeRO stage 1, bf16, units=model;" in out
    assert "(bf16-mixed-adamw, stage 1," in out  # the ranks' engine: their ledger's recipe
