"""fp16 with dynamic loss scaling on real gloo ranks (N = 2): against torch DDP with
``torch.amp.GradScaler`` on the same model and batches, with an overflow injected on one
rank at chosen steps, the same steps are skipped and the same scales result; a skipped
step leaves the weights untouched on every rank; fp16 without a scaler is an error at
the first step."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist

STEPS, OVERFLOW = 12, (4, 5, 9)  # steps whose batch rank 1 multiplies by inf
SETTINGS = {"init_scale": 2.0 ** 10, "growth_interval": 3}


# DeepSpeed fp16 blocks and the scales DeepSpeed 0.19.8's own DynamicLossScaler.update_scale
# gives after each step for overflows at OVERFLOW (fed the same flags; measured): its rule
# grows when the steps since the last overflow, less one, are a positive multiple of the
# window, and a shrink does not refill the hysteresis budget (so step 9 halves without
# consecutive_hysteresis, which refills it on every good step).
_DS = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2}
DEEPSPEED_BLOCKS = {
    "dynamic": _DS,
    "consecutive": {**_DS, "consecutive_hysteresis": True},
    "static": {"enabled": True, "loss_scale": 256},
}
DEEPSPEED_SCALES = {
    "dynamic": [1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0,
                512.0, 512.0],
    "consecutive": [1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 1024.0,
                    1024.0, 1024.0, 1024.0],
    "static": [256.0] * STEPS,
}


def _batch(step):
    x, y = cases.batch("mlp", step)
    if step in OVERFLOW and dist.get_rank() == 1:
        x = x * math.inf
    return x, y


def _zeroshard(stage, hysteresis=1, deepspeed=None):
    net = zs.shard(cases.build("mlp"), stage=stage, mixed_precision="fp16")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = (zs.GradScaler(net, hysteresis=hysteresis, **SETTINGS) if deepspeed is None
              else zs.GradScaler.from_deepspeed(net, {"fp16": deepspeed}))
    skipped, scales, untouched = [], [], []
    for step in range(STEPS):
        before = net.full_state_dict()
        scaler.scale(net(*_batch(step))).backward()
        scaler.unscale_(opt)
        net.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(net.last_step_skipped)
        scales.append(scaler.get_scale())
        if net.last_step_skipped:
            untouched.append(cases.bit_equal(net.full_state_dict(), before))
    weights = net.full_state_dict()
    return {"skipped": skipped, "scales": scales, "untouched": untouched,
            "finite": all(torch.isfinite(w).all() for w in weights.values())}


def _ddp():
    model = cases.build("mlp")
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    skipped, scales = [], []
    for step in range(STEPS):
        scaler.scale(net(*_batch(step))).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return {"skipped": skipped, "scales": scales}


def _no_scaler():
    net = zs.shard(cases.build("mlp"), stage=2, mixed_precision="fp16")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(*cases.batch("mlp", 0)).backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return "stepped"


def _grid():
    return {"ddp": _ddp(), 1: _zeroshard(1), 3: _zeroshard(3), "hysteresis": _zeroshard(3, 2),
            "no scaler": _no_scaler(),
            **{("deepspeed", name): _zeroshard(2, deepspeed=block)
               for name, block in DEEPSPEED_BLOCKS.items()}}


@pytest.fixture(scope="module")
def ranks():
    return spawn(_grid, 2, timeout=300)


@pytest.mark.parametrize("stage", [1, 3])
def test_same_skips_and_scales_as_torch_ddp_and_grad_scaler(ranks, stage):
    ddp = ranks[0]["ddp"]
    assert ddp["skipped"] == [s in OVERFLOW for s in range(STEPS)]  # the reference's own
    for r in ranks:  # every rank alike
        got = r[stage]
        assert got["skipped"] == ddp["skipped"] and got["scales"] == ddp["scales"], (got, ddp)
        assert got["untouched"] == [True] * len(OVERFLOW) and got["finite"]


def test_hysteresis_2_shrinks_only_at_the_second_overflow_in_a_row(ranks):
    """DeepSpeed's hysteresis: steps 4 and 5 overflow in a row, so the scale halves at
    5 only; step 9's overflow alone does not shrink it."""
    got = ranks[0]["hysteresis"]
    assert got["skipped"] == [s in OVERFLOW for s in range(STEPS)]
    scale = SETTINGS["init_scale"]
    want = []
    good = run = 0
    for s in range(STEPS):
        if s in OVERFLOW:
            good, run = 0, run + 1
            if run == 2:
                scale, run = scale / 2, 0
        else:
            run, good = 0, good + 1
            if good == SETTINGS["growth_interval"]:
                scale, good = scale * 2, 0
        want.append(scale)
    assert got["scales"] == want


@pytest.mark.parametrize("name", sorted(DEEPSPEED_BLOCKS))
def test_deepspeed_fp16_block_gives_deepspeeds_skips_and_scales(ranks, name):
    for r in ranks:
        got = r[("deepspeed", name)]
        assert got["skipped"] == [s in OVERFLOW for s in range(STEPS)]
        assert got["scales"] == DEEPSPEED_SCALES[name], got["scales"]
        assert got["untouched"] == [True] * len(OVERFLOW) and got["finite"]


def test_deepspeed_scale_sequences_are_deepspeeds_own(monkeypatch):
    """The sequences above, regenerated from DeepSpeed's class where it is installed (its
    log lines ask deepspeed.comm for the rank, which here has no group: rank 0)."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)
    for name, block in DEEPSPEED_BLOCKS.items():
        if "loss_scale" in block:
            continue
        ds = loss_scaler.DynamicLossScaler(2.0 ** 10, 3, 1, 2,
                                           block.get("consecutive_hysteresis", False))
        scales = []
        for s in range(STEPS):
            ds.update_scale(s in OVERFLOW)
            scales.append(ds.cur_scale)
        assert scales == DEEPSPEED_SCALES[name]


def test_deepspeed_fp16_block_from_a_file_names_unknown_keys(tmp_path, recwarn):
    path = tmp_path / "ds.json"
    path.write_text('{"fp16": {"enabled": true, "hysteresis": 3, "auto_cast": false}}')
    model = SimpleNamespace(stepper=SimpleNamespace(attach_scaler=lambda scaler: None))
    scaler = zs.GradScaler.from_deepspeed(model, str(path))
    assert (scaler.get_scale(), scaler.hysteresis) == (2.0 ** 16, 3)  # DeepSpeed's default power
    assert [str(w.message) for w in recwarn.list] == [
        "DeepSpeed fp16 keys ignored by zeroshard: auto_cast"]


def test_deepspeed_fp16_block_is_checked():
    with pytest.raises(ValueError, match=r"needs a DeepSpeed config whose fp16 block"):
        zs.GradScaler.from_deepspeed(object(), {"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"fp16.loss_scale=-1; expected 0 \(dynamic\)"):
        zs.GradScaler.from_deepspeed(object(), {"fp16": {"enabled": True, "loss_scale": -1}})
    with pytest.raises(ValueError, match=r"fp16.hysteresis='2' must be a number"):
        zs.GradScaler.from_deepspeed(object(), {"fp16": {"enabled": True, "hysteresis": "2"}})
    with pytest.raises(ValueError, match=r"fp16.loss_scale_window=0; expected at least 1"):
        zs.GradScaler.from_deepspeed(object(), {"fp16": {"enabled": True,
                                                         "loss_scale_window": 0}})


def test_fp16_without_a_scaler_is_refused_at_the_first_step(ranks):
    msg = ranks[0]["no scaler"]
    assert msg.startswith("mixed_precision='fp16': fp16 gradients overflow and underflow "
                          "without dynamic loss scaling"), msg
    assert "zs.GradScaler(model)" in msg


def test_bad_scaler_settings_are_named():
    with pytest.raises(ValueError, match=r"GradScaler: backoff_factor=2 is out of range"):
        zs.GradScaler(object(), backoff_factor=2)


def test_deepspeed_fp16_block_turns_fp16_on():
    ds = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    assert zs.ZeroConfig.from_dict(ds).mixed_precision == "fp16"
    with pytest.raises(ValueError, match="bf16.enabled and fp16.enabled are both true"):
        zs.ZeroConfig.from_dict({**ds, "bf16": {"enabled": True}})
