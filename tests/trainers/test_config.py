"""Without a process group: what ``zero=`` resolves to beside ``TrainingArguments`` (as
the Trainer fills a DeepSpeed config's "auto" values), DeepSpeed's schedulers against
DeepSpeed's own classes, and ``zeroshard plan --deepspeed``."""

from __future__ import annotations

import json

import pytest
import torch

from zeroshard.hf.resolve import fill_steps, resolve
from zeroshard.hf.schedules import DeepSpeedWarmup, deepspeed_optimizer
from zeroshard.spec.config import ZeroConfig

from . import hf_cases
from . import models as m


@pytest.fixture(scope="module")
def targs(tmp_path_factory):
    """TrainingArguments of one process, no process group (the ranks' pass gloo)."""
    return m.args(str(tmp_path_factory.mktemp("args")), ddp_backend=None)


@pytest.fixture(scope="module")
def llama():
    return m.llama()


def test_zero_forms_and_the_precision_they_leave_open(targs, llama, tmp_path):
    assert resolve(None, targs, llama).config == ZeroConfig()
    assert resolve({"stage": 1}, targs, llama).config == ZeroConfig(stage=1)
    given = ZeroConfig(stage=2, units=None)
    assert resolve(given, targs, llama).config is given
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 0, "reduce_bucket_size": 0}))
    assert resolve(str(path), targs, llama).config == ZeroConfig(stage=0, reduce_bucket_size=0)
    bf16 = m.args(str(tmp_path), bf16=True, ddp_backend=None)
    assert resolve({"stage": 3}, bf16, llama).config.mixed_precision == "bf16"
    assert resolve(None, bf16, llama).config.recipe.name == "bf16-mixed-adamw"


IGNORED = ("DeepSpeed config keys ignored by zeroshard: zero_optimization.contiguous_gradients, "
           "zero_optimization.overlap_comm")


def test_deepspeed_auto_values_are_filled_as_the_trainer_fills_them(targs, llama):
    with pytest.warns(UserWarning, match=IGNORED):  # named once, in one warning
        r = resolve(hf_cases.DS_AUTO, targs, llama)
    h = llama.config.hidden_size
    assert (r.config.stage, r.config.reduce_bucket_size, r.config.prefetch_bucket_size,
            r.config.param_persistence_threshold) == (3, h * h, int(0.9 * h * h), 10 * h)
    assert r.config.mixed_precision is None and r.optimizer is None and r.scheduler is None
    # the values given must be the TrainingArguments' (HfTrainerDeepSpeedConfig.fill_match)
    agree = {**hf_cases.DS_AUTO, "train_micro_batch_size_per_gpu": 2,
             "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    with pytest.warns(UserWarning, match=IGNORED):
        assert resolve(agree, targs, llama).config.stage == 3
    with pytest.raises(ValueError, match=r"ds train_micro_batch_size_per_gpu=4 vs hf "
                                         r"per_device_train_batch_size=2; ds gradient_clipping"):
        resolve({**agree, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5},
                targs, llama)


def test_a_zero2_config_drops_the_stage3_auto_sizes(targs, llama):
    ds = json.loads(json.dumps(hf_cases.DS_AUTO))
    ds["zero_optimization"]["stage"] = 2
    with pytest.warns(UserWarning, match=IGNORED):
        r = resolve(ds, targs, llama)
    assert (r.config.stage, r.config.reduce_bucket_size, r.config.prefetch_bucket_size,
            r.config.param_persistence_threshold) == (2, 32 * 32, 0, 0)


def test_optimizer_and_scheduler_sections(targs, llama):
    ds = {"zero_optimization": {"stage": 1},
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {
              "warmup_num_steps": "auto", "total_num_steps": "auto",
              "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}}
    r = resolve(ds, targs, llama)
    assert r.optimizer["params"] == {"lr": 1e-2, "weight_decay": 0.1}
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    params[1].requires_grad_(False)
    opt = deepspeed_optimizer(r.optimizer, params)
    # DeepSpeed's Adam is AdamW (adam_w_mode) over every trainable parameter, one group
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert len(opt.param_groups[0]["params"]) == 1
    assert opt.param_groups[0]["eps"] == 1e-8 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    filled = fill_steps(r.scheduler, 100, 10)["params"]
    assert (filled["total_num_steps"], filled["warmup_num_steps"]) == (100, 10)
    assert fill_steps(r.scheduler, 100, 0)["params"]["warmup_num_steps"] == 1
    off = {**ds, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    assert type(deepspeed_optimizer(resolve(off, targs, llama).optimizer, params[:1])) is (
        torch.optim.Adam)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
@pytest.mark.parametrize("curve", ["log", "linear"])
def test_schedulers_set_deepspeeds_learning_rates(kind, curve):
    """As DeepSpeed's engine drives its scheduler: built before the first step, stepped
    after each optimizer step; the lr each optimizer step uses, over 12 steps."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    decay = {"total_num_steps": 10} if kind == "WarmupDecayLR" else {}
    options = dict(warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=4,
                   warmup_type=curve, **decay)

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = make(opt)
        out = []
        for _ in range(12):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    theirs = lrs(lambda o: getattr(lr_schedules, kind)(o, **options))
    assert lrs(lambda o: DeepSpeedWarmup(o, **options)) == pytest.approx(theirs, abs=1e-12)


def test_plan_reads_a_trainers_deepspeed_json(tmp_path, capsys):
    from zeroshard.cli import main

    ds = {**hf_cases.DS_AUTO, "zero_optimization": {
        **hf_cases.DS_AUTO["zero_optimization"], "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert main(["plan", "--model", "llama2-7b", "--gpus", "8", "--deepspeed", str(path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["strategy"] for s in out["strategies"]] == ["ZeRO-3"]
    assert out["strategies"][0]["offload"] == "optimizer"
    assert main(["plan", "--deepspeed", str(path), "--strategy", "ZeRO-1"]) == 2
    assert "--strategy=ZeRO-1 contradicts --deepspeed" in capsys.readouterr().err
    path.write_text(json.dumps({"stage": 2, "mixed_precision": "fp32"}))  # a ZeroConfig's
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["strategy"] for s in out["strategies"]] == ["ZeRO-2"]
    assert out["recipe"] == "fp32-adamw"
