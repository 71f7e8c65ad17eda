"""`zeroshard train`: configuration, the loss curve across stages and N, the command."""

import json
import warnings

import pytest

from zeroshard.cli import main
from zeroshard.runtime.spawn import spawn
from zeroshard.train.config import TrainConfig, from_deepspeed, resolve
from zeroshard.train.loop import train

pytestmark = pytest.mark.dist


def _curves(cases):
    return {key: train(TrainConfig(**kw))["losses"] for key, kw in cases.items()}


def _grid(world):
    base = dict(model="tiny", steps=6, batch=8, eval_every=100, eval_batches=1, sample_chars=0)
    cases = {("fp32", s): dict(base, stage=s) for s in range(4)}
    if world == 2:
        cases[("accum", 2)] = dict(base, stage=2, micro_batch=2)
        cases[("accum", 0)] = dict(base, stage=0, micro_batch=2)
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
    return train(TrainConfig(model="tiny", stage=stage, steps=1, batch=8, eval_every=100,
                             eval_batches=1, sample_chars=0))["memory"]


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_summary_of_a_single_step(stage):
    """The summary reads gradients before the step and the optimizer's state after it,
    so a run of one step (whose step creates Adam's state) shows both as planned."""
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import get_recipe, model_state_bytes

    mem = spawn(_one_step, 2, stage, timeout=300)[0]
    params = sum(p.numel() for p in GPT(get_preset("tiny")).parameters())
    weights, grads, optimizer = model_state_bytes(params, 2, get_recipe("fp32-adamw"), stage)
    assert (mem["grads"], mem["optimizer"]) == (grads, optimizer)


def test_the_command_trains_and_logs(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code = main(["train", "--nproc", "2", "--model", "tiny", "--steps", "30", "--eval-every",
                 "15", "--lr", "1e-2", "--json-log", str(log), "--sample-chars", "20"])
    assert code == 0
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
    with pytest.warns(UserWarning, match="ignored by zeroshard: optimizer.type, "
                                         "zero_optimization.overlap_comm"):
        out = from_deepspeed(ds, nproc=2)
    assert out == {"stage": 2, "precision": "bf16", "clip": 0.5, "batch": 16, "micro_batch": 2,
                   "param_persistence_threshold": 10000, "reduce_bucket_size": 500_000_000,
                   "prefetch_bucket_size": 50_000_000}
    assert TrainConfig(**out).accumulation(2) == (2, 4)


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not a ZeRO stage"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes' must be true or false"),
    ({"train_batch_size": -8}, "train_batch_size=-8 must be a positive integer"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}},
     "zero_optimization.reduce_bucket_size='big' must be a whole number"),
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
    assert (cfg.stage, cfg.steps, cfg.lr) == (1, 9, 0.5)
    path.write_text(json.dumps({"stages": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['stages'\]"):
        resolve({}, str(path))


@pytest.mark.parametrize("argv,message", [
    (["--batch", "7", "--nproc", "2"], "batch=7 does not divide over 2 processes"),
    (["--micro-batch", "3"], "micro_batch=3 does not divide the 8 sequences"),
    (["--model", "huge"], "model='huge'; expected one of tiny, small, medium"),
    (["--steps", "0"], "steps=0 must be a positive number"),
    (["--resume", "/nonexistent"], "/nonexistent is not a zeroshard checkpoint"),
    (["--init-from", "/nonexistent"], "init_from='/nonexistent': no such file"),
])
def test_bad_flags_fail_before_launch(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err
