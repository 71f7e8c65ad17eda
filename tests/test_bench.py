"""A smoke run of the side-by-side benchmark (tiny preset, few steps): every
implementation trains the same function."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

BENCH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"


def test_compare_smoke():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--steps", "3", "--rounds", "1", "--impl",
         "zeroshard-1,zeroshard-3,ddp,ddp+zero,fsdp2-reshard,limit"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    losses = dict(re.findall(r"^(\S+)\s+median.*loss ([\d.]+)$", out, re.M))
    assert set(losses) == {"zeroshard-1", "zeroshard-3", "ddp", "ddp+zero", "fsdp2-reshard",
                           "limit"}
    same = {losses[k] for k in ("zeroshard-1", "zeroshard-3", "ddp", "ddp+zero",
                                "fsdp2-reshard")}
    assert len(same) == 1, losses  # the same function, to the printed digits
    assert "zeroshard-3:" in out and "x fsdp2-reshard" in out
    live = dict(re.findall(r"^(\S+)\s+median.*live peak\s+([\d.]+) MB", out, re.M))
    assert set(live) == set(losses) and all(float(v) > 0 for v in live.values()), out


def test_rounds_are_pooled():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from compare import _combine
    finally:
        sys.path.remove(str(BENCH.parent))
    run = dict(iqr=0.0, state=1, comm=2, live=None)
    a = {**run, "times": [1.0, 2.0, 3.0], "peak": 10, "loss": 0.5}
    b = {**run, "times": [4.0, 5.0], "peak": 30, "loss": 0.5}
    r = _combine([a, b])
    assert r["median"] == 3.0 and r["times"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert r["peak"] == 30 and r["live"] is None and r["state"] == 1
    assert "differs between rounds" in _combine([a, {**b, "loss": 0.6}])["error"]
    assert _combine([a, {"error": "rank 1 failed"}]) == {"error": "rank 1 failed"}
