"""torch.distributed.checkpoint with the optimizers that are not elementwise: Adafactor
(row statistics with an entry per row, a column statistic the same on every rank) and
Muon beside AdamW (two optimizers over one model). On 2 gloo ranks a stage-3 run is
saved through torch's state-dict functions after 3 steps, loaded at stage 1 by a fresh
model and fresh optimizers, and trained 3 more: bit for bit the uninterrupted run (the
same N, so the same sums), and every optimizer state tensor as saved."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import zeroshard as zs
from zeroshard.runtime.spawn import spawn

from ..engine import engine_cases as cases

pytestmark = pytest.mark.dist


def _optimizers(net, kind: str) -> list:
    if kind == "adafactor":
        return [torch.optim.Adafactor(net.parameters(), lr=1e-2)]
    matrices = [p for p in net.parameters() if p.dim() == 2]
    rest = [p for p in net.parameters() if p.dim() != 2]
    return [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]


def _steps(net, opts, first: int, count: int) -> None:
    for step in range(first, first + count):
        net(*cases.batch("mlp", step)).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _states(net, opts) -> dict:
    _, optim = get_state_dict(net, opts)
    return {f"{k}/{n}": _full(v).clone() for k, s in optim["state"].items()
            for n, v in s.items() if torch.is_tensor(v)}


def _grid(root: str) -> dict:
    out = {}
    for kind in ("adafactor", "muon"):
        torch.manual_seed(0)
        net = zs.shard(cases.build("mlp"), stage=3)
        opts = _optimizers(net, kind)
        _steps(net, opts, 0, 3)
        model_sd, optim_sd = get_state_dict(net, opts)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{kind}")
        saved = _states(net, opts)
        _steps(net, opts, 3, 3)
        through = {k: v.clone() for k, v in net.full_state_dict().items()}

        torch.manual_seed(1)  # other initial weights: the load must replace them
        again = zs.shard(cases.build("mlp"), stage=1)
        fresh = _optimizers(again, kind)
        _steps(again, fresh, 0, 1)  # state to load into
        model_sd, optim_sd = get_state_dict(again, fresh)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/{kind}")
        set_state_dict(again, fresh, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        loaded = _states(again, fresh)
        _steps(again, fresh, 3, 3)
        resumed = again.full_state_dict()
        out[kind] = {
            "state_keys": sorted(saved) == sorted(loaded),
            "state_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "weights_equal": all(torch.equal(through[k], resumed[k]) for k in through),
            "row_stats_are_dtensors": kind != "adafactor" or any(
                isinstance(v, DTensor) and n == "row_var" for s in
                get_state_dict(again, fresh)[1]["state"].values() for n, v in s.items()),
        }
    return out


def test_dcp_round_trip_of_adafactor_and_muon(tmp_path):
    got = spawn(_grid, 2, str(tmp_path), timeout=240)
    for rank in got:
        for kind, checks in rank.items():
            assert all(checks.values()), (kind, checks)
