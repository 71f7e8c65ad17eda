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
