"""Non-finite gradients on real gloo ranks: rank 1's input times inf at step 3 is raised,
skipped or ignored as ``ZeroConfig.nonfinite`` says, identically on every rank; a
skipped step leaves the weights and optimizer state exactly as a run that never saw
that batch."""

import math

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.runtime.spawn import spawn
from zeroshard.runtime.stepping import NonFiniteGradients

from . import engine_cases as cases

pytestmark = pytest.mark.dist

POISON = 2  # the step (0-based) whose batch rank 1 multiplies by inf
STEPS = 5


def _run(stage: int, policy: str, clip: bool, poison: bool, leave_out=()):
    net = zs.shard(cases.build("mlp"), stage=stage, config={"nonfinite": policy})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    skipped = []
    for step in range(STEPS):
        if step in leave_out:
            continue
        x, y = cases.batch("mlp", step)
        if poison and step == POISON and dist.get_rank() == 1:
            x = x * math.inf
        net(x, y).backward()
        if clip:
            net.clip_grad_norm_(1.0)
        try:
            opt.step()
        except NonFiniteGradients as exc:
            return {"raised": str(exc), "at": step}
        opt.zero_grad()
        skipped.append(net.last_step_skipped)
    steps = {int(s["step"]) for s in opt.state.values()}
    return {"weights": net.full_state_dict(), "skipped": skipped, "count": net.skipped_steps,
            "adam_steps": steps}


def _grid():
    out = {}
    for stage, clip in ((0, False), (3, False), (2, True)):
        out[("raise", stage, clip)] = _run(stage, "raise", clip, poison=True)
    for stage, clip in ((0, False), (1, True), (2, False), (3, True)):
        out[("skip", stage, clip)] = _run(stage, "skip", clip, poison=True)
        out[("reference", stage, clip)] = _run(stage, "raise", clip, poison=False,
                                               leave_out=(POISON,))
    out[("ignore", 1, False)] = _run(1, "ignore", False, poison=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_grid, 2, timeout=300)


@pytest.mark.parametrize("stage,clip", [(0, False), (3, False), (2, True)])
def test_raise_stops_every_rank_with_one_message(ranks, stage, clip):
    got = [r[("raise", stage, clip)] for r in ranks]
    assert got[0] == got[1] and got[0]["at"] == POISON, got
    msg = got[0]["raised"]
    assert f"non-finite gradients at step {POISON + 1}" in msg and "nonfinite='skip'" in msg
    if clip:
        assert "the global gradient norm is nan" in msg
    else:  # which units hold them, rank by rank: the NaN reached every rank's rows
        assert "rank 0's rows of unit" in msg and "rank 1's rows of unit" in msg


@pytest.mark.parametrize("stage,clip", [(0, False), (1, True), (2, False), (3, True)])
def test_skip_is_exactly_a_run_without_that_batch(ranks, stage, clip):
    for r in ranks:
        got, ref = r[("skip", stage, clip)], r[("reference", stage, clip)]
        assert got["skipped"] == [k == POISON for k in range(STEPS)]
        assert got["count"] == 1 and got["adam_steps"] == ref["adam_steps"] == {STEPS - 1}
        assert all(torch.isfinite(w).all() for w in got["weights"].values())
        for name, w in ref["weights"].items():
            assert torch.equal(got["weights"][name], w), name
    assert all(torch.equal(ranks[0][("skip", stage, clip)]["weights"][k], w)
               for k, w in ranks[1][("skip", stage, clip)]["weights"].items())


def test_ignore_lets_the_step_make_every_rank_non_finite(ranks):
    for r in ranks:
        got = r[("ignore", 1, False)]
        assert got["skipped"] == [False] * STEPS and got["count"] == 0
        assert all(torch.isnan(w).all() for k, w in got["weights"].items() if "weight" in k)


def test_a_bad_policy_is_named():
    with pytest.raises(ValueError, match=r"nonfinite='never'; expected one of 'raise', "
                                         r"'skip', 'ignore'"):
        zs.ZeroConfig(nonfinite="never")
