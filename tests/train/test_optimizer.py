"""``--optimizer`` and the learning-rate schedule: the planner's names built as the engine
steps them, their settings checked, DeepSpeed's ``optimizer`` and ``scheduler`` sections
honoured (type and params) or refused by name; a Muon run saved and resumed."""

import json
import math

import pytest
import torch

from zeroshard.cli import main
from zeroshard.models.gpt import GPT, get_preset
from zeroshard.optim import Lamb
from zeroshard.train.lrschedule import lr_lambda
from zeroshard.train.optimizer import Schedules, build_optimizer, each, schedule
from zeroshard.train.settings import TrainConfig, from_deepspeed, resolve


def _gpt():
    return GPT(get_preset("tiny"))


@pytest.mark.parametrize("name,kind", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD),
                                       ("lamb", Lamb), ("adafactor", torch.optim.Adafactor)])
def test_each_name_builds_its_optimizer(name, kind):
    opt = build_optimizer(_gpt(), TrainConfig(optimizer=name, lr=0.01))
    assert type(opt) is kind and opt.param_groups[0]["lr"] == 0.01
    if name != "adafactor":  # decay on matrices only
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert all(p.dim() >= 2 for p in opt.param_groups[0]["params"])
    if name == "sgd":
        assert opt.param_groups[0]["momentum"] == 0.9


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest():
    model = _gpt()
    muon, adamw = build_optimizer(model, TrainConfig(optimizer="muon", momentum=0.9,
                                                     betas=[0.8, 0.9]))
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = {names[id(p)] for p in muon.param_groups[0]["params"]}
    rest = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert hidden and all(model.get_parameter(n).dim() == 2 for n in hidden)
    assert {"wte.weight", "wpe.weight"} <= rest and not hidden & rest
    assert hidden | rest == set(names.values())
    assert muon.param_groups[0]["momentum"] == 0.9
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert adamw.param_groups[0]["betas"] == (0.8, 0.9)


def test_muons_pair_is_scheduled_saved_and_loaded_together():
    opts = build_optimizer(_gpt(), TrainConfig(optimizer="muon", steps=10, warmup=2))
    s = schedule(opts, lr_lambda(TrainConfig(steps=10, warmup=2)))
    assert isinstance(s, Schedules) and len(each(opts)) == 2
    for o in each(opts):
        o.step()
    s.step()
    state = s.state_dict()
    again = schedule(opts, lr_lambda(TrainConfig(steps=10, warmup=2)))
    again.load_state_dict(state)
    assert again.get_last_lr() == s.get_last_lr()
    with pytest.raises(ValueError, match="saved with another --optimizer"):
        again.load_state_dict(state[0])


@pytest.mark.parametrize("settings,message", [
    ({"optimizer": "adam"}, "optimizer='adam'; expected one of adamw, sgd, lamb, adafactor, muon"),
    ({"optimizer": "sgd", "betas": [0.9, 0.95]},
     r"betas=\[0.9, 0.95\] is a setting of adamw, lamb and muon only, not of optimizer='sgd', "
     "which takes momentum"),
    ({"optimizer": "adafactor", "eps": 1e-8},
     "eps=1e-08 is a setting of adamw, lamb and muon only, not of optimizer='adafactor'"),
    ({"betas": [0.9]}, r"betas=\[0.9\]; expected two numbers in \[0, 1\)"),
    ({"betas": [0.9, 1.0]}, r"betas=\[0.9, 1.0\]; expected two numbers"),
    ({"optimizer": "sgd", "momentum": 1.0}, r"momentum=1.0; expected a number in \[0, 1\)"),
    ({"eps": float("nan")}, "eps=nan; expected a small positive number"),
    ({"schedule": "step"}, "schedule='step'; expected one of cosine, linear, constant"),
    ({"min_lr_ratio": 2}, "min_lr_ratio=2; expected a number from 0 to 1"),
    ({"warmup_type": "exp"}, "warmup_type='exp'; expected one of linear, log"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_the_default_schedule_is_unchanged():
    """Linear warm-up from lr / W, then cosine to a tenth (the trainer's since its start)."""
    f = lr_lambda(TrainConfig(steps=100, warmup=10))
    assert [f(s) for s in (0, 9)] == [0.1, 1.0]
    assert f(10) == 1.0 and f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)


def test_deepspeeds_optimizer_and_scheduler_sections_are_honoured():
    ds = {"zero_optimization": {"stage": 2},
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.95],
                                                    "eps": 1e-6, "weight_decay": 0.01,
                                                    "torch_adam": True}},
          "scheduler": {"type": "WarmupDecayLR",
                        "params": {"warmup_min_lr": 0.0001, "warmup_max_lr": 0.001,
                                   "warmup_num_steps": 4, "total_num_steps": 20}}}
    out = from_deepspeed(ds, nproc=2)
    assert {k: v for k, v in out.items() if k != "zero"} == {
        "optimizer": "adamw", "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01,
        "schedule": "linear", "warmup": 4, "warmup_type": "log", "lr": 0.001,
        "warmup_start_ratio": pytest.approx(0.1), "min_lr_ratio": 0.0, "decay_steps": 20}
    cfg = TrainConfig(**{**out, "steps": 30})
    f = lr_lambda(cfg)
    # DeepSpeed's log warm-up from warmup_min_lr, then linear to 0 at total_num_steps
    assert f(0) * cfg.lr == pytest.approx(0.0001)
    assert f(1) == pytest.approx(0.1 + 0.9 * math.log(2) / math.log(4))
    assert f(4) == 1.0 and f(12) == pytest.approx(0.5) and f(20) == f(29) == 0.0


def test_warmup_cosine_and_muon_from_deepspeed(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "Muon",
                                                         "params": {"lr": 0.02, "momentum": 0.9}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 2, "cos_min_ratio": 0.05,
                                 "warmup_type": "linear"}}}))
    cfg = resolve({"steps": 12}, str(path))
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.schedule, cfg.min_lr_ratio) == (
        "muon", 0.02, 0.9, "cosine", 0.05)
    assert lr_lambda(cfg)(1) == 1.0 and lr_lambda(cfg)(12) == pytest.approx(0.05)


@pytest.mark.parametrize("section,message", [
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type='OneBitAdam'; zeroshard's "
     "trainer runs Adam and AdamW"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
     "optimizer.params.adam_w_mode=False: zeroshard's adamw runs with adam_w_mode=True only"),
    ({"optimizer": {"type": "Lamb", "params": {"max_coeff": 10}}},
     "optimizer.params.max_coeff is not a setting zeroshard's trainer reads"),
    ({"optimizer": {"params": {}}}, "must be a JSON object with a \"type\""),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type='OneCycle'; zeroshard's trainer "
     "runs WarmupLR, WarmupDecayLR and WarmupCosineLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
     "scheduler.params: 'warmup_steps' not known to WarmupLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
     "a resumed run's step comes from its checkpoint"),
])
def test_what_cannot_be_honoured_is_refused_by_name(section, message):
    with pytest.raises(ValueError, match=message):
        from_deepspeed({"zero_optimization": {"stage": 1}, **section}, nproc=2)


def test_a_setting_given_in_both_words_is_refused(tmp_path):
    path = tmp_path / "both.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "lr": 0.01,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.001}}}))
    with pytest.raises(ValueError, match="lr is given twice"):
        resolve({}, str(path))


@pytest.mark.dist
@pytest.mark.slow
def test_a_muon_run_resumes_as_it_would_have_gone_on(tmp_path, capfd):
    """Muon's pair and its two schedules survive a checkpoint: 4 steps, then 4 more
    resumed, end where 8 straight do."""
    base = ["train", "--nproc", "2", "--model", "tiny", "--optimizer", "muon", "--steps",
            "8", "--sample-chars", "0", "--eval-every", "100", "--stage", "3"]
    assert main([*base, "--json-log", str(tmp_path / "straight.jsonl")]) == 0
    ckpt = tmp_path / "ckpt"
    assert main([*base, "--save-dir", str(ckpt), "--save-every", "4", "--steps", "8",
                 "--json-log", str(tmp_path / "a.jsonl")]) == 0
    assert main([*base, "--save-dir", str(tmp_path / "ckpt2"), "--resume",
                 str(ckpt / "step-000004"), "--json-log", str(tmp_path / "b.jsonl")]) == 0
    straight = [json.loads(x)["loss"] for x in (tmp_path / "straight.jsonl").read_text()
                .splitlines()]
    resumed = [json.loads(x)["loss"] for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert resumed == straight[4:]
