"""Every input of docs/bad-inputs.md gets exactly the one line written beside it.

The catalogue is the test's data: each table row is an input and the line it gets.
Command-line inputs run in this process through ``zeroshard.cli.main`` (nothing they
check launches anything); the Python API's run against a group of one; the inputs
whose error is found inside the ranks run as real ``zeroshard train`` launches, as few
as the catalogue has. ``{tmp}`` is a folder of fixtures made once (a trainer's
checkpoint, its export, damaged copies, a file, JSON files); in a line, ``…`` stands
for any text (an errno's wording, a path that differs by machine).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from zeroshard.checkpoint import savedir
from zeroshard.checkpoint.consolidated import export
from zeroshard.cli import main
from zeroshard.models.gpt import GPT, get_preset
from zeroshard.train.config import TrainConfig
from zeroshard.train.loop import train

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"
LAUNCHED = "inside the ranks"  # the section whose inputs are real launches
API = "Python API"


def _cell(text: str) -> str:
    text = text.strip().replace("\\|", "|")
    for tick in ("``", "`"):
        if text.startswith(tick) and text.endswith(tick):
            return text[len(tick):-len(tick)].strip()
    return text


def catalogue() -> list[tuple[str, str, str]]:
    """(section, input, line) for every row of the catalogue's tables."""
    rows, section = [], ""
    for raw in DOC.read_text(encoding="utf-8").splitlines():
        if raw.startswith("## "):
            section = raw[3:].strip()
        elif raw.startswith("| `"):
            cells = re.split(r"(?<!\\)\|", raw)[1:-1]
            rows.append((section, _cell(cells[0]), _cell(cells[1])))
    return rows


ROWS = catalogue()


def _sub(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


def _expected(line: str, tmp: Path) -> re.Pattern:
    parts = [re.escape(_sub(p, tmp)) for p in line.split("…")]
    return re.compile(".*".join(parts), re.DOTALL)


@pytest.fixture(scope="module")
def world():
    """A process group of one in this process (the environment untouched, so the
    in-process commands still launch as a user's would)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tmp(world, tmp_path_factory) -> Path:
    """The fixtures the catalogue names under ``{tmp}``."""
    root = tmp_path_factory.mktemp("bad")
    (root / "file.txt").write_text("a file, not a folder\n")
    (root / "config.json").write_text('{"a": 1}\n')
    (root / "list.json").write_text("[1, 2]\n")
    (root / "bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    train(TrainConfig(nproc=1, model="tiny", steps=2, batch=2, eval_every=2, eval_batches=1,
                      sample_chars=0, save_dir=str(root / "ckpt")))
    model = zs.shard(GPT(get_preset("tiny")), stage=0)
    zs.save(model, torch.optim.AdamW(model.parameters()), root / "plain")
    export(root / "ckpt", root / "export")
    export(root / "ckpt", root / "brokenexport", max_shard_bytes=50_000)
    (root / "brokenexport" / "model-00002-of-00004.safetensors").unlink()
    shutil.copytree(root / "ckpt", root / "damaged")
    rank0 = root / "damaged" / "step-000002" / "rank00000.safetensors"
    with open(rank0, "r+b") as f:
        f.truncate(rank0.stat().st_size // 2)
    shutil.copytree(root / "ckpt" / "step-000002", root / "badmanifest")
    (root / "badmanifest" / "manifest.json").write_text("{")
    (root / "held").mkdir()
    (root / "held" / savedir.LOCK).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}))
    (root / "blocked").mkdir()  # the final save's unfinished copy has a file in its way
    (root / "blocked" / "step-000004.partial").write_text("in the way")
    _folders_of_other_programs(root)
    return root


def _folders_of_other_programs(root: Path) -> None:
    """Checkpoint folders another program wrote: torch.distributed.checkpoint's, and
    copies of ``ckpt``'s step whose manifest is of a newer version or names a file outside
    its folder, and a ``latest`` pointer that leads out of its folder."""
    (root / "dcp").mkdir()
    (root / "dcp" / ".metadata").write_bytes(b"\x80\x04")
    (root / "dcp" / "__0_0.distcp").write_bytes(b"")
    for name, change in (("future", lambda m: m.update(version=2)),
                         ("escape", lambda m: m.update(files={
                             f"../{k}": v for k, v in m["files"].items()}))):
        shutil.copytree(root / "ckpt" / "step-000002", root / name)
        manifest = json.loads((root / name / "manifest.json").read_text())
        change(manifest)
        (root / name / "manifest.json").write_text(json.dumps(manifest))
    (root / "badpointer").mkdir()
    (root / "badpointer" / "latest").write_text("../ckpt/step-000002\n")


def _argv(text: str, tmp: Path) -> tuple[dict[str, str], list[str]]:
    """The environment a row sets before its command (``RANK=0 zeroshard ...``) and the
    command's arguments; ``--config '{...}'`` stands for a file holding that JSON
    (``{tmp}/given.json``)."""
    argv = shlex.split(_sub(text, tmp))
    env = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0], re.DOTALL):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    assert argv[0] == "zeroshard", text
    argv = argv[1:]
    for k, arg in enumerate(argv):
        if k and argv[k - 1] == "--config" and arg[:1] and arg[:1] in "{[":
            path = tmp / "given.json"
            path.write_text(arg)
            argv[k] = str(path)
    return env, argv


def _one_line(err: str, line: str, tmp: Path, what: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, f"{what}: {len(lines)} lines on stderr:\n{err}"
    assert _expected(line, tmp).fullmatch(lines[0]), f"{what}:\n got  {lines[0]}\n want {line}"


def test_the_catalogue_is_large_and_covers_every_command():
    sections = {s for s, _, _ in ROWS}
    assert len(ROWS) >= 120, len(ROWS)
    for name in ("zeroshard plan", "zeroshard train", "--config", "zeroshard export",
                 "zeroshard inspect", "zeroshard bench", "zeroshard demo", API, LAUNCHED):
        assert any(name in s for s in sections), (name, sections)
    inputs = [i for _, i, _ in ROWS]
    assert len(inputs) == len(set(inputs)), "an input is listed twice"


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's errors: one line, then exit 2
        return exc.code


@pytest.mark.parametrize("section,text,line",
                         [r for r in ROWS if r[0] != API and LAUNCHED not in r[0]],
                         ids=lambda v: v if len(v) < 60 else v[:57] + "...")
def test_a_command_gets_its_one_line(section, text, line, tmp, capfd):
    _command(text, line, tmp, capfd)


def _command(text: str, line: str, tmp: Path, capfd) -> None:
    """Run the command (in the environment the row sets); it must fail with exactly
    ``line`` on stderr."""
    env, argv = _argv(text, tmp)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = _run(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capfd.readouterr()
    assert code != 0, f"{text}: exit code 0\n{out}"
    _one_line(err, line, tmp, text)


def _api_namespace(tmp: Path) -> dict:
    model = zs.shard(GPT(get_preset("tiny")), stage=3)

    class NoParameters(nn.Module):
        def forward(self, x):
            return x

    return {"zs": zs, "nn": nn, "torch": torch, "GPT": GPT, "get_preset": get_preset,
            "model": model, "opt": torch.optim.AdamW(model.parameters()),
            "NoParameters": NoParameters}


@pytest.mark.parametrize("section,text,line", [r for r in ROWS if r[0] == API],
                         ids=lambda v: v if len(v) < 60 else v[:57] + "...")
def test_a_call_gets_its_one_error(section, text, line, tmp):
    with pytest.raises(Exception) as info:
        exec(_sub(text, tmp), _api_namespace(tmp))
    got = f"{type(info.value).__name__}: {info.value}"
    assert "\n" not in got.strip(), got
    assert _expected(line, tmp).fullmatch(got), f"{text}:\n got  {got}\n want {line}"


@pytest.mark.dist
@pytest.mark.parametrize("section,text,line", [r for r in ROWS if LAUNCHED in r[0]],
                         ids=lambda v: v if len(v) < 60 else v[:57] + "...")
def test_a_rank_error_is_one_line_from_the_launcher(section, text, line, tmp, capfd):
    """Real launches: the ranks' error once, without the launcher's report."""
    _command(text, line, tmp, capfd)


# Beyond the rows: what the catalogue's table cannot hold (output that is not an error,
# a signal sent to a rank, one rank's input differing from another's).


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
    assert "…" not in table and "1.920e+53" in table


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
    from zeroshard.commands.train import _config

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
