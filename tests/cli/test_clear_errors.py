"""Issue 20's items beyond the bad-input catalogue (tests/cli/test_bad_inputs.py): exports
written whole, checkpoint retention, what the trainer says it saved and loaded, the
planned traffic under accumulation, warnings and output notes as one line each.

Real files and real processes: an in-process group of one makes the checkpoint the
exports come from; the trainer's behaviour is checked on two real launches."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from zeroshard._paths import RECORD
from zeroshard.checkpoint import savedir
from zeroshard.checkpoint.consolidated import _weight_map, export
from zeroshard.checkpoint.exportdir import INDEX, SINGLE
from zeroshard.cli import main
from zeroshard.plan import ParallelDims, ZeroConfig, get_recipe
from zeroshard.plan.memory import comm_bytes
from zeroshard.train.failure import told
from zeroshard.train.loop import train
from zeroshard.train.report import planned_comm
from zeroshard.train.settings import TrainConfig, processes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint zeroshard train's loop saved of GPT tiny at step 2 (a group of one in
    this process, the environment untouched)."""
    root = tmp_path_factory.mktemp("ckpt")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train(TrainConfig(nproc=1, model="tiny", steps=2, batch=2, eval_every=2,
                          eval_batches=1, sample_chars=0, save_dir=str(root)))
    finally:
        dist.destroy_process_group()
    return root


def _listing(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_a_re_export_leaves_no_stale_shards_or_index(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the user's file beside the weights
    sharded = export(ckpt, out, max_shard_bytes=50_000)
    assert len(sharded) > 2 and (out / INDEX).exists()
    (out / f".{SINGLE}.partial").write_text("left by an export that was stopped")
    single = export(ckpt / "latest", out, dtype="bf16")  # the pointer file itself
    assert list(single) == [SINGLE]
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "config.json", SINGLE]
    assert set(_weight_map(out).values()) == {out / SINGLE}  # the new weights are read


def test_a_failed_export_leaves_the_folder_as_it_was(ckpt, tmp_path):
    """A file size limit stops the export part-way (as a full disk would): one line, the
    older export untouched, nothing half-written beside it."""
    out = tmp_path / "out"
    export(ckpt, out, max_shard_bytes=50_000)
    before = _listing(out)
    script = ("import resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))\n"
              "from zeroshard.cli import main\n"
              f"sys.exit(main(['export', {str(ckpt)!r}, {str(out)!r}]))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("zeroshard export: error: export not written: ") and \
        lines[0].endswith(f"File too large; {out} is as it was"), lines
    assert _listing(out) == before


def test_export_help_example_names_a_path_that_works(ckpt, tmp_path, capsys):
    from zeroshard.commands import export

    example = next(line.split() for line in export.__doc__.splitlines()
                   if line.startswith("  zeroshard export "))
    assert example[2] == "runs/ckpt/latest"  # the documented form: the latest pointer
    assert main(["export", str(ckpt / "latest"), str(tmp_path / "out"), *example[4:]]) == 0
    # the tiny GPT's 36 parameters (q, k and v apart: 8 more than fused; the tied head once)
    assert "wrote 36 tensors to 1 file(s)" in capsys.readouterr().out


def _folders(root: Path, manifests: int) -> list[Path]:
    made = []
    for k in range(1, manifests + 1):
        (root / f"step-{k:06d}").mkdir()
        (root / f"step-{k:06d}" / "manifest.json").write_text(
            '{"format": "zeroshard-checkpoint", "files": {}}')
        made.append(root / f"step-{k:06d}")
        time.sleep(0.01)  # distinct modification times
    return made


def test_keep_last_removes_the_oldest_saves_never_latest(tmp_path):
    a, b, c, d = _folders(tmp_path, 4)
    (tmp_path / "best").mkdir()  # not the trainer's: never removed
    (tmp_path / "latest").write_text("step-000001\n")  # a run resumed from step 1 ...
    os.utime(a / "manifest.json")  # ... saved it again last
    removed = savedir.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-000002", "step-000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "step-000001",
                                                          "step-000004"]


def test_the_planned_traffic_counts_every_micro_batch():
    p, on2 = 1_000_000, ParallelDims(2)

    def r(stage, **options):
        return ZeroConfig(stage=stage, mixed_precision=get_recipe("fp32-adamw"), **options)

    assert planned_comm(p, on2, r(3), 1) == comm_bytes(p, on2, r(3))
    assert planned_comm(p, on2, r(3), 4) == 4 * comm_bytes(p, on2, r(3))  # gathers and reduces
    assert planned_comm(p, on2, r(0), 2) == 2 * comm_bytes(p, on2, r(0))
    # stages 1-2: each backward reduce-scatters; the weights are gathered once, after the step
    assert planned_comm(p, on2, r(1), 3) == comm_bytes(p, on2, r(1)) + 2 * 2_000_000
    # hybrid, 4 ranks in groups of 2: per micro-batch 2 MB reduced inside and 2 MB
    # all-reduced across; 2 MB gathered after the step
    assert planned_comm(p, ParallelDims(4, shard=2), r(2, shard_group=2), 2) == (
        2 * (2 + 2) * 10**6 + 2 * 10**6)


def test_one_process_is_singular():
    assert (processes(1), processes(2)) == ("1 process", "2 processes")


def test_a_deepspeed_warning_is_one_line(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True},
                                "fp16": {"enabled": False, "loss_scale_window": 500}}))
    assert main(["train", "--config", str(path), "--nproc", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("zeroshard train: warning: DeepSpeed config keys ignored by zeroshard: "
                      "fp16.loss_scale_window, zero_optimization.overlap_comm"), err
    assert err[1:] == ["zeroshard train: error: --nproc=0 must be a positive number"], err


def test_plan_notes_every_written_file_on_stderr(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    html, png = tmp_path / "p.html", tmp_path / "p.png"
    assert main(["plan", "--json", "--html", str(html), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout stays JSON
    assert err.splitlines() == [f"wrote {html}", f"wrote {png}"]


def test_a_rank_killed_without_an_error_is_named(tmp_path):
    line, code = told(tmp_path, {1: (-9, "SIGKILL")}, 1)
    assert code == 1 and line.startswith("zeroshard train: error: rank 1 was killed by SIGKILL")
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "line": "x: error: y",
                                                     "code": 2}))
    assert told(tmp_path, {1: (-15, "SIGTERM"), 0: (2, "")}, 1) == ("x: error: y", 2)
    # a rank that only lost its peer is not the story, even if it ended first
    (tmp_path / "rank1.json").write_text(json.dumps(
        {"rank": 1, "line": "x: error: RuntimeError: closed (ZEROSHARD_DEBUG=1 for the full "
                            "trace)", "code": 1}))
    assert told(tmp_path, {1: (1, ""), 0: (2, "")}, 1) == ("x: error: y", 2)


@pytest.mark.dist
def test_granularity_bench_writes_nothing_uninvited(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "granularity", "--model", "tiny", "--steps", "4", "--batch",
                 "4"]) == 0
    assert list(tmp_path.iterdir()) == []


def _mb(out: str, row: str) -> float:
    return float(re.search(rf"│\s+{row} │[^│]*│\s+([\d.]+) │", out).group(1))


@pytest.mark.dist
@pytest.mark.slow
def test_the_trainer_says_what_it_loaded_saved_removed_and_resumed(ckpt, tmp_path, capfd):
    weights, runs = tmp_path / "export", tmp_path / "runs"
    export(ckpt, weights)
    common = ["train", "--model", "tiny", "--batch", "8", "--sample-chars", "0",
              "--save-dir", str(runs)]
    assert main([*common, "--nproc", "2", "--steps", "3", "--micro-batch", "2",
                 "--eval-every", "3", "--init-from", str(weights), "--save-every", "1",
                 "--keep-last", "2"]) == 0
    out = " ".join(capfd.readouterr().out.split())
    assert f"loaded weights from {weights}" in out
    assert f"step 1: saved checkpoint {runs / 'step-000001'}" in out
    assert f"step 3: saved checkpoint {runs / 'step-000003'} (removed step-000001: " \
           "keep_last=2)" in out
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == ["step-000002",
                                                                  "step-000003"]
    assert "│ planned │ 2 micro-batches │" in out  # accumulation: each backward reduces
    # measured 0.418 against 0.416: the checks' fingerprints and the clip's all-reduce
    # aside (one micro-batch's plan, the old figure, was half of it: 0.208)
    assert abs(_mb(out, "total") - _mb(out, "planned")) < 0.0025
    assert main([*common, "--nproc", "1", "--steps", "4", "--resume", "latest"]) == 0
    out = " ".join(capfd.readouterr().out.split())
    assert "(34,688 params), 1 process, ZeRO stage 3" in out
    assert f"resumed from {runs / 'step-000003'} (step 3)" in out


@pytest.mark.dist
@pytest.mark.slow
def test_ctrl_c_is_one_line(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: the launcher stops the
    ranks and says so once (it was every rank's KeyboardInterrupt and the agent's trace)."""
    import signal

    run = subprocess.Popen([sys.executable, "-m", "zeroshard", "train", "--nproc", "2",
                            "--model", "tiny", "--steps", "100000", "--batch", "4",
                            "--sample-chars", "0", "--save-dir", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        for line in run.stdout:  # the ranks are training once rank 0 has evaluated
            if "val loss" in line:
                break
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err
    assert err.splitlines() == ["zeroshard train: stopped by SIGINT; checkpoints saved "
                                "before it are complete"], err
    assert not (tmp_path / savedir.LOCK).exists()  # the save folder is free again
