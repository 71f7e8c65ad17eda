"""Issue 31's cases that the catalogue's table cannot hold (docs/bad-inputs.md holds
the rest): output that is not an error (the plan's verdict), a signal sent to a running
rank, one rank's argument differing from another's, the environment a helper reads,
and the help text. Real processes where the case needs them: one `zeroshard train`
launch whose rank 1 is killed, and two spawned ranks that save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.cli import main
from zeroshard.models.gpt import GPT, get_preset


def test_a_plan_no_cluster_can_hold_says_why(capsys):
    """--params 10^15 in 1 GB per GPU: no activations are modelled, so the verdict names
    the bytes ZeRO-3 still needs on the most GPUs searched (it blamed the activations);
    a figure too large for its column is written in powers of ten (it was cut to "…")."""
    assert main(["plan", "--params", str(10**15), "--gpu-mem", "1"]) == 0
    out = capsys.readouterr().out
    assert "activations" not in out.splitlines()[-1]
    assert " ".join(out.split()).endswith(
        "nothing fits: even ZeRO-3 on 1,048,576 GPUs, the most the planner searches, needs "
        "15,258,789,063 bytes per GPU, above the budget of 1,000,000,000")
    assert main(["plan", "--tokens", str(10**30)]) == 0
    table = capsys.readouterr().out
    assert "…" not in table and "1.940e+53" in table


def test_a_rank_killed_without_an_error_is_named_before_the_others_losing_it(tmp_path):
    """The surviving rank's gloo error (an unexpected type, told with the debug hint) no
    longer hides that the other rank was killed; a rank the launcher itself stopped
    (SIGTERM) is the last to be blamed."""
    from zeroshard.train.failure import told

    (tmp_path / "rank0.json").write_text(json.dumps({
        "rank": 0, "code": 1, "line": "zeroshard train: error: RuntimeError: [pair.cc:537] "
        "Read error [127.0.0.1]:21185: Connection reset by peer (ZEROSHARD_DEBUG=1 for the "
        "full trace)"}))
    line, code = told(tmp_path, {0: (1, ""), 1: (-9, "SIGKILL")}, 0)
    assert code == 1 and line.startswith(
        "zeroshard train: error: rank 1 was killed by SIGKILL without an error of its own "
        "(out of memory, or killed from outside?); rank 0 then stopped, having lost it"), line
    (tmp_path / "rank0.json").unlink()
    assert told(tmp_path, {0: (-15, "SIGTERM"), 1: (-9, "SIGKILL")}, 0)[0].startswith(
        "zeroshard train: error: rank 1 was killed by SIGKILL")


def test_ranks_that_fail_under_spawn_are_one_line():
    """zeroshard demo and bench run their ranks through spawn: every rank's traceback
    was the error line (37 lines for the demo's allocation error); now the first
    failing rank's error is."""
    from zeroshard._errorline import line_of
    from zeroshard.runtime.spawn import RankFailure

    tracebacks = {r: "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                     "RuntimeError: DefaultCPUAllocator: not enough memory" for r in (1, 3)}
    failure = RankFailure("2 of 4 ranks failed:\n" + "\n".join(tracebacks.values()),
                          tracebacks)
    assert line_of(failure, "zeroshard demo") == (
        "zeroshard demo: error: RankFailure: 2 rank(s) failed; rank 1: RuntimeError: "
        "DefaultCPUAllocator: not enough memory (ZEROSHARD_DEBUG=1 for the full trace)", 1)


def test_leftover_rank_variables_are_named_by_init_distributed(monkeypatch):
    from zeroshard.runtime.dist import _check_rank_environment

    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as info:
        _check_rank_environment()
    assert str(info.value) == (
        "RANK=0, WORLD_SIZE=2 in the environment make this process a rank of a job, but "
        "MASTER_ADDR and MASTER_PORT are not set: start every rank with torchrun, or unset "
        "RANK and WORLD_SIZE (left from an earlier launch?) for a group of one")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' in the environment must be an "
                                         "integer"):
        _check_rank_environment()


def test_max_skipped_is_the_flag_the_help_names(capsys):
    from zeroshard.cli import build_parser
    from zeroshard.commands.train import config_of as _config

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--max-skipped" in capsys.readouterr().out
    args = build_parser("train").parse_args(["train", "--max-skipped", "3"])
    assert _config(args).max_skipped == 3


def _save_with_an_rng_state_on_rank_0(path: str):
    """Rank 0 puts a tensor in ``extra``, rank 1 a number: both must raise at once."""
    import time

    model = zs.shard(GPT(get_preset("tiny")), stage=3)
    opt = torch.optim.AdamW(model.parameters())
    extra = {"rng": torch.get_rng_state()} if dist.get_rank() == 0 else {"rng": 0}
    start = time.monotonic()
    try:
        zs.save(model, opt, path, extra=extra)
    except ValueError as exc:
        return str(exc), time.monotonic() - start, os.path.exists(path + ".partial")
    return None, time.monotonic() - start, None


@pytest.mark.dist
def test_a_bad_extra_on_one_rank_stops_every_rank_at_once(tmp_path):
    from zeroshard.runtime.spawn import spawn

    ranks = spawn(_save_with_an_rng_state_on_rank_0, 2, str(tmp_path / "ckpt"), timeout=120)
    want = ("zs.save(): extra['rng'] is a torch.Tensor, which the manifest (JSON) cannot "
            "hold: zs.save already keeps every rank's torch RNG state and zs.load restores "
            "it; for another tensor give its .tolist()")
    assert [r[0] for r in ranks] == [want, want]
    assert all(r[1] < 10 for r in ranks), ranks  # no rank waited for a timeout
    assert not any(r[2] for r in ranks) and not (tmp_path / "ckpt").exists()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_a_rank_killed_by_a_signal_is_named_by_the_launcher(tmp_path):
    """SIGKILL to rank 1 of a running `zeroshard train`: the one line names it and the
    signal first (it was rank 0's gloo "Connection reset by peer")."""
    import signal
    import subprocess
    import sys
    import time

    run = subprocess.Popen([sys.executable, "-m", "zeroshard", "train", "--nproc", "2",
                            "--model", "tiny", "--steps", "100000", "--batch", "4",
                            "--sample-chars", "0"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in run.stdout:  # both ranks are past their set-up once rank 0 evaluated
            if "val loss" in line:
                break
        ranks = [r for launcher in _children(run.pid) for r in _children(launcher)]
        rank1 = next(r for r in ranks if b"\0RANK=1\0" in
                     b"\0" + Path(f"/proc/{r}/environ").read_bytes())
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert time.monotonic() - start < 30 and run.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "zeroshard train: error: rank 1 was killed by SIGKILL without an error of its own "
        "(out of memory, or killed from outside?); rank 0 then stopped, having lost it"), err
