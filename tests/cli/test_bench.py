"""A smoke run of the side-by-side benchmark (tiny preset, few steps): every
implementation trains the same function. The runs of the benchmark scripts themselves
(each a launch of a few ranks per member) are in the slow tier: what they measure is
the engine the main tier tests, and their figures come from ``bench/``."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

BENCH = Path(__file__).resolve().parents[2] / "bench" / "compare.py"


@pytest.mark.slow
def test_compare_smoke():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--steps", "3", "--rounds", "1", "--impl",
         "zeroshard-3,ddp,fsdp2-reshard,limit"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    losses = dict(re.findall(r"^(\S+)\s+median.*loss ([\d.]+)$", out, re.M))
    assert set(losses) == {"zeroshard-3", "ddp", "fsdp2-reshard", "limit"}
    same = {losses[k] for k in ("zeroshard-3", "ddp", "fsdp2-reshard")}
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


def test_gloo_collectives_smoke():
    """The engine's gloo collectives give torch's results bit for bit, and hold no
    staging copy of the gathered buffer in flight (torch's all-gather holds one)."""
    out = subprocess.run(
        [sys.executable, str(BENCH.parent / "gloo_collectives.py"), "--mb", "4", "--ranks", "2"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^\s+2\s+(\w+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+([\d.]+)\s+([\d.]+)\s+(\w+)$",
                      out, re.M)
    assert {r[0] for r in rows} == {"reduce_scatter", "all_gather"}, out
    assert all(r[3] == "True" for r in rows), out
    gather = next(r for r in rows if r[0] == "all_gather")
    assert float(gather[1]) >= 3.9 and float(gather[2]) < 1.0, out  # a 4 MB buffer, or none
    # the reduce-scatter written from sends sums what the all-reduce does
    assert "reduce_scatter as a ring of sends" in out and "1e-6: True" in out, out


@pytest.mark.slow
def test_paired_smoke(tmp_path):
    """Step-by-step pairs in the same ranks: both members train the same function, and the
    ratio is the median of the per-step ratios inside its bootstrap interval."""
    report = tmp_path / "paired.json"
    out = subprocess.run(
        [sys.executable, str(BENCH.parent / "paired.py"), "--preset", "tiny", "--steps", "6",
         "--pairs", "zeroshard-0:ddp,zeroshard-3:fsdp2-reshard", "--reduce-bucket-size",
         "100000", "--json", str(report)],
        capture_output=True, text=True, timeout=600, check=True).stdout
    data = json.loads(report.read_text())
    results = data["results"]
    assert data["args"]["reduce_bucket_size"] == 100000
    assert [r["pair"] for r in results] == [["zeroshard-0", "ddp"],
                                             ["zeroshard-3", "fsdp2-reshard"]], out
    for r in results:
        a, b = r["loss"]
        assert abs(a - b) < 1e-6, r  # the same function
        assert r["steps"] == 3 and r["ci95"][0] <= r["ratio"] <= r["ci95"][1], r
        assert [len(t) for t in r["times_s"]] == [3, 3], r
    bad = subprocess.run([sys.executable, str(BENCH.parent / "paired.py"), "--pairs", "ddp"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'A:B'" in bad.stderr


@pytest.mark.slow
def test_paired_runs(tmp_path):
    """``--runs 3``: every pair three times in fresh processes, the pairs taking turns,
    and the median of the three ratios with their spread."""
    report = tmp_path / "paired.json"
    out = subprocess.run(
        [sys.executable, str(BENCH.parent / "paired.py"), "--preset", "tiny", "--steps", "5",
         "--pairs", "zeroshard-2:fsdp2-noreshard,ddp:ddp", "--runs", "3", "--json",
         str(report)], capture_output=True, text=True, timeout=600, check=True).stdout
    data = json.loads(report.read_text())
    pairs = [["zeroshard-2", "fsdp2-noreshard"], ["ddp", "ddp"]]
    assert [(r["run"], r["pair"]) for r in data["results"]] == [
        (k, p) for k in range(3) for p in pairs], out
    assert all(r["same"] for r in data["results"]), out
    for pair, median in zip(pairs, data["medians"]):
        ratios = [r["ratio"] for r in data["results"] if r["pair"] == pair]
        assert median["pair"] == pair and median["ratios"] == ratios, out
        assert median["median"] == sorted(ratios)[1], out
        line = next(x for x in out.splitlines() if x.startswith(f"{pair[0]:18} against"))
        assert f"ratio {sorted(ratios)[1]:.3f}x" in line and "spread" in line, line
    assert out.count("run 3/3") == 2, out
    bad = subprocess.run([sys.executable, str(BENCH.parent / "paired.py"), "--runs", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--runs=0 must be at least 1" in bad.stderr


def test_paired_ratio():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from paired import paired_ratio
    finally:
        sys.path.remove(str(BENCH.parent))
    # a slow spell that hits both members of a step cancels in their ratio
    b = [1.0, 1.0, 2.0, 2.0, 1.0, 3.0, 1.0]
    a = [0.9 * x for x in b]
    mid, lo, hi = paired_ratio(a, b)
    assert mid == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(0.9)
    mid, lo, hi = paired_ratio([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0])
    assert mid == 2.5 and 1.0 <= lo <= mid <= hi <= 4.0
    # The interval is the central 95 % of the resampled medians, not their range: one
    # outlier in 7 steps is the median of a resample 1 % of the time (four or more of
    # its 7 draws), so it lies outside the interval though some resamples reach it.
    assert paired_ratio([1.0] * 6 + [100.0], [1.0] * 7) == (1.0, 1.0, 1.0)
    assert paired_ratio([1.0] * 6 + [0.01], [1.0] * 7) == (1.0, 1.0, 1.0)
    assert paired_ratio([1.0] * 4 + [100.0], [1.0] * 5)[2] == 100.0  # there: 5.8 %
    assert paired_ratio([1.0, 2.0, 3.0, 4.0], [1.0] * 4) == (mid, lo, hi)  # seeded
    with pytest.raises(ValueError, match="equally many"):
        paired_ratio([1.0], [1.0, 2.0])
