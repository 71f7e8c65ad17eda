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
import torch.nn as nn

import zeroshard as zs
from zeroshard.checkpoint import savedir
from zeroshard.checkpoint.consolidated import export
from zeroshard.cli import main
from zeroshard.models.gpt import GPT, get_preset
from zeroshard.train.loop import train
from zeroshard.train.settings import TrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
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
    # four files (the tiny GPT's 139 kB, its q, k and v apart, in files of 45 kB at most)
    export(root / "ckpt", root / "brokenexport", max_shard_bytes=45_000)
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
    _folders_of_the_users(root)
    train(TrainConfig(nproc=1, model="tiny", steps=2, batch=2, eval_every=2, eval_batches=1,
                      sample_chars=0, lora=4, save_dir=str(root / "lorackpt")))
    (root / "kv2").mkdir()  # a Llama with 2 key/value heads
    (root / "kv2" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
        "vocab_size": 1000}))
    return root


def _folders_of_the_users(root: Path) -> None:
    """Folders that hold the user's own files where a command would write: each must be
    refused by name, nothing in it touched ([Note: a writer owns only what it wrote])."""
    (root / "empty").mkdir()
    (root / "mydata").mkdir()
    (root / "mydata" / "thesis.txt").write_text("the user's own")
    (root / "userweights").mkdir()  # the model a run started from, say
    (root / "userweights" / "model.safetensors").write_bytes(b"the user's own")
    (root / "userprofile").mkdir()
    (root / "userprofile" / "lifetimes.png").write_bytes(b"the user's own")
    (root / "dsout.partial").mkdir()
    (root / "dsout.partial" / "notes.txt").write_text("the user's own")
    (root / "dsmissing" / "global_step3").mkdir(parents=True)  # latest names a tag not there
    (root / "dsmissing" / "latest").write_text("global_step5")


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
    assert len(ROWS) >= 300, len(ROWS)
    for name in ("zeroshard plan", "zeroshard train", "zeroshard verify", "--config",
                 "zeroshard export",
                 "zeroshard inspect", "zeroshard import-deepspeed", "zeroshard bench",
                 "zeroshard demo", API, LAUNCHED):
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


def _launched() -> list:
    """The real launches: the first two in the main tier, the rest (five seconds each)
    in the slow tier."""
    rows = [r for r in ROWS if LAUNCHED in r[0]]
    return rows[:2] + [pytest.param(*r, marks=pytest.mark.slow) for r in rows[2:]]


@pytest.mark.dist
@pytest.mark.parametrize("section,text,line", _launched(),
                         ids=lambda v: v if len(v) < 60 else v[:57] + "...")
def test_a_rank_error_is_one_line_from_the_launcher(section, text, line, tmp, capfd):
    """Real launches: the ranks' error once, without the launcher's report."""
    _command(text, line, tmp, capfd)

