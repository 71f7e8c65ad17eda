"""Restarts (docs/elastic.md): a rank killed, frozen or killed inside a save, or a node
lost, costs the steps since the last save, and the run goes on at the world it has.

Real launches on loopback: torchrun (``--standalone``, and two agents sharing a
rendezvous) and ``zeroshard train --max-restarts``, with faults put into the ranks by
``tests/train/faultsite/sitecustomize.py``. Each launch checks what it can (the resume steps,
the lines, the JSON records, the final weights against an uninterrupted run): a launch
costs seconds, a restart a few more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.train.resume import checkpoint_to_resume
from zeroshard.train.settings import TrainConfig

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
#: Every launch: 40 steps of a batch of 8, a checkpoint every 10.
RUN = ["--steps", "40", "--batch", "8", "--eval-every", "100", "--sample-chars", "0",
       "--save-every", "10", "--resume", "auto"]
GPT = [*RUN, "--model", "tiny"]


def _env(tmp: Path, faults: list[dict] | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE / "faultsite"), str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    if faults:
        env["ZEROSHARD_TEST_FAULTS"] = json.dumps(faults)
        env["ZEROSHARD_TEST_FAULT_LOG"] = str(tmp / "faults.jsonl")
    return env


def _run(cmd: list[str], env: dict, timeout: float = 300) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _train(*args) -> list[str]:
    return [sys.executable, "-m", "zeroshard", "train", *args]


def _log(path: Path) -> tuple[list[dict], list[dict]]:
    """(the steps' records, the restarts' records) of a JSON log."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return ([r for r in rows if "event" not in r],
            [r for r in rows if r.get("event") == "restart"])


def _tensors(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return {(f.name, k): v for f in sorted(ckpt.glob("rank*.safetensors"))
            for k, v in load_file(f).items()}


def _same_weights(a: Path, b: Path) -> None:
    """Every tensor of two checkpoints (weights, AdamW's moments and step, RNG state)
    equal bit for bit."""
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 10
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not differ, f"{len(differ)} of {len(ta)} tensors differ: {differ[:5]}"


def _restarted(out: str, log: Path, resumed: list[int], ckpts: Path, world: int = 2) -> None:
    """Each restart is one line of the output and one record of the JSON log, resuming
    the steps ``resumed``; the run then trains to step 40."""
    lines = [x for x in out.splitlines() if x.startswith("restart ")]
    assert len(lines) == len(resumed), out
    for k, (line, step) in enumerate(zip(lines, resumed), start=1):
        assert line.startswith(f"restart {k}: resumed from {ckpts / f'step-{step:06d}'} "
                               f"(step {step}): weights, optimizer state, schedule, at N = "
                               f"{world}"), line
    steps, restarts = _log(log)
    assert [r["resumed_from"] for r in restarts] == resumed, restarts
    assert [r["restart"] for r in restarts] == list(range(1, len(resumed) + 1))
    assert steps[-1]["step"] == 40
    assert [r["step"] for r in steps[-(40 - resumed[-1]):]] == list(range(resumed[-1] + 1, 41))


@pytest.mark.slow
def test_torchrun_restarts_after_a_kill_and_a_kill_in_a_save_end_bit_for_bit(tmp_path):
    """Plain torchrun (its c10d rendezvous and shared store, no setting), stage 3: rank 1
    killed at step 15 (resumes from 10), then killed half-way through its file of the
    step-30 save (resumes from 20); step 40 equals an uninterrupted run's bit for bit."""
    _run(_train(*GPT, "--stage", "3", "--save-dir", str(tmp_path / "ref")), _env(tmp_path))
    faults = [{"attempt": 0, "rank": 1, "step": 15, "how": "kill"},
              {"attempt": 1, "rank": 1, "step": 30, "how": "kill-in-save"}]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "2", "-m", "zeroshard", "train", *GPT, "--stage", "3",
           "--save-dir", str(tmp_path / "run"), "--json-log", str(tmp_path / "log.jsonl")]
    out = _run(cmd, _env(tmp_path, faults))
    _restarted(out, tmp_path / "log.jsonl", [10, 20], tmp_path / "run")
    _same_weights(tmp_path / "run" / "step-000040", tmp_path / "ref" / "step-000040")


def _llama(root: Path) -> Path:
    """A Llama of a few thousand parameters, without a tokenizer (it trains on the
    built-in corpus's bytes)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama")
    return root / "llama"


@pytest.mark.slow
def test_zeroshard_train_restarts_a_killed_and_a_frozen_rank_of_a_hf_model(tmp_path):
    """``zeroshard train --max-restarts``, a Hugging Face Llama at stage 0: rank 1 killed at
    step 15 (resumes from 10), then frozen by SIGSTOP at step 25: rank 0's collective
    times out (12 s), the launcher restarts both (resumes from 20); step 40 equals an
    uninterrupted run's bit for bit, and a restart costs seconds."""
    pytest.importorskip("transformers")
    run = [*RUN, "--hf-model", str(_llama(tmp_path)), "--seq-len", "32", "--stage", "0",
           "--timeout", "12"]
    _run(_train(*run, "--save-dir", str(tmp_path / "ref")), _env(tmp_path))
    faults = [{"attempt": 0, "rank": 1, "step": 15, "how": "kill"},
              {"attempt": 1, "rank": 1, "step": 25, "how": "stop"}]
    out = _run(_train(*run, "--save-dir", str(tmp_path / "run"), "--max-restarts", "2",
                      "--json-log", str(tmp_path / "log.jsonl")), _env(tmp_path, faults))
    _restarted(out, tmp_path / "log.jsonl", [10, 20], tmp_path / "run")
    _same_weights(tmp_path / "run" / "step-000040", tmp_path / "ref" / "step-000040")
    fired = [json.loads(x)["time"] for x in (tmp_path / "faults.jsonl").read_text().splitlines()]
    _, restarts = _log(tmp_path / "log.jsonl")
    # from the fault to the restarted ranks' start: the launcher's detection and restart
    # (the frozen rank: the 12 s timeout, 5 s for the others' roll call, 5 s grace); bounds
    # loose enough for a loaded machine, far below torch's default 30-minute timeout
    assert 0 < restarts[0]["process_start"] - fired[0] < 60, (fired, restarts)
    assert 15 < restarts[1]["process_start"] - fired[1] < 90, (fired, restarts)


def test_resume_auto_starts_fresh_only_where_no_save_completed(tmp_path):
    """No folder, or one where a run was stopped in its first save (only a ``.partial``
    copy): a first start. A folder with ``latest``: its checkpoint (checked in the
    launches above and, refused for another run's settings, in docs/bad-inputs.md)."""
    cfg = TrainConfig(save_dir=str(tmp_path / "d"), resume="auto")
    assert checkpoint_to_resume(cfg) is None
    (tmp_path / "d" / "step-000010.partial").mkdir(parents=True)
    assert checkpoint_to_resume(cfg) is None


@pytest.mark.slow
def test_a_lost_node_leaves_the_run_at_n_2_resumed_from_its_last_save(tmp_path):
    """Two torchrun agents of two ranks each (``--nnodes 1:2``), their rendezvous served by
    this test on loopback (a cluster's would be); the node of rank 0 is lost at step 15
    (its agent and both its ranks SIGKILLed). The other agent restarts its ranks: the run
    says which ranks were lost, goes on at N = 2 from step 10 (the global batch kept) and
    finishes, with the losses of a run started at N = 2 from that checkpoint."""
    from datetime import timedelta

    from zeroshard.runtime.dist import loopback_store

    store = loopback_store("127.0.0.1", 0, 0, 1, timedelta(seconds=300))  # the rendezvous
    run = [*GPT, "--steps", "20", "--timeout", "30"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "lost-node",
           "--rdzv-conf", "is_host=0,last_call_timeout=4,keep_alive_interval=1,"
           "keep_alive_max_attempt=2", "-m", "zeroshard", "train", *run,
           "--save-dir", str(tmp_path / "run"), "--json-log", str(tmp_path / "log.jsonl")]
    env = _env(tmp_path, [{"attempt": 0, "rank": 0, "step": 15, "how": "node"}])
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert sorted(a.returncode for a in agents) == [-9, 0], outs
    out = outs[[a.returncode for a in agents].index(0)]
    ckpt = tmp_path / "run" / "step-000010"
    line = next((x for x in out.splitlines() if x.startswith("restart ")), out)
    assert line == (f"restart 1: ranks 0-1 of 4 lost; resumed from {ckpt} (step 10): weights, "
                    "optimizer state, schedule; now at N = 2, saved at N = 4: global batch 8 = "
                    "2 x 4 x 1 micro-batch(es)"), line
    steps, restarts = _log(tmp_path / "log.jsonl")
    assert [(r["lost_ranks"], r["world"], r["saved_world"], r["resumed_from"])
            for r in restarts] == [([0, 1], 2, 4, 10)]
    assert [r["step"] for r in steps[-10:]] == list(range(11, 21))
    again = [*run, "--nproc", "2", "--resume", str(ckpt), "--save-dir", str(tmp_path / "again"),
             "--json-log", str(tmp_path / "again.jsonl")]
    _run(_train(*again), _env(tmp_path))
    at_two, _ = _log(tmp_path / "again.jsonl")
    assert [r["loss"] for r in steps[-10:]] == [r["loss"] for r in at_two]


def test_the_line_of_a_restart_without_a_checkpoint_and_of_a_resume_at_another_n(tmp_path):
    """What ``restart.announce`` says where no launch above goes: a restart before the
    first save, a rerun of the command at another N (its nodes are another launch's: no
    rank is called lost), and no line at all for a first start."""
    from types import SimpleNamespace

    from zeroshard.train.restart import announce

    said = []
    log = tmp_path / "log.jsonl"
    with open(log, "w") as fh:
        run = SimpleNamespace(cfg=TrainConfig(save_dir="runs/ckpt", steps=40, batch=8),
                              world=1, micro=8, accum=1, nodes=["h:9"], log=fh,
                              out=SimpleNamespace(line=said.append))
        announce(run, None, {}, 0, 0.0)
        announce(run, None, {}, 1, 0.0)
        extra = {"step": 10, "world": 2, "nodes": ["h:1", "h:1"]}
        announce(run, Path("runs/ckpt/step-000010"), extra, 0, 0.1)
        announce(run, Path("runs/ckpt/step-000040"), {**extra, "step": 40}, 0, 0.1)
    assert said == [
        "restart 1: no checkpoint in runs/ckpt yet: training again from step 0 at N = 1",
        "resumed from runs/ckpt/step-000010 (step 10): weights, optimizer state, schedule; "
        "now at N = 1, saved at N = 2: global batch 8 = 1 x 8 x 1 micro-batch(es)",
        "runs/ckpt/step-000040 is at step 40 of 40: nothing to train"]
    _, restarts = _log(log)
    assert [(r["restart"], r["resumed_from"], r["checkpoint"]) for r in restarts] == \
        [(1, 0, None)]
