"""The slow tier: the docs' three examples run as a user runs them (torchrun, or Lightning's
own launcher), and bench/trainers.py's smoke run (its pairs must train the same function,
or it exits 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _run(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _torchrun(script: str, cwd: Path) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(ROOT / "examples" / script)], cwd)


def test_hf_trainer_example(tmp_path):
    out = _torchrun("hf_trainer.py", tmp_path)
    assert "ZeRO stage 3; rank 0 holds" in out
    run = tmp_path / "runs" / "hf_trainer"
    assert (run / "checkpoint-40" / "zeroshard" / "manifest.json").is_file()
    assert (run / "final" / "model.safetensors").is_file()


def test_trl_sft_example(tmp_path):
    _torchrun("trl_sft.py", tmp_path)
    assert (tmp_path / "runs" / "trl_sft" / "final" / "model.safetensors").is_file()


def test_lightning_example(tmp_path):
    out = _run([sys.executable, str(ROOT / "examples" / "lightning_fit.py")], tmp_path)
    assert "val_loss" in out
    assert (tmp_path / "runs" / "lightning" / "final.ckpt" / "zeroshard").is_dir()


def test_bench_smoke(tmp_path):
    out = _run([sys.executable, str(ROOT / "bench" / "trainers.py"), "--rounds", "1",
                "--steps", "3", "--warmup", "1"], tmp_path)
    assert "zs0:ddp:" in out and "zs3:fsdp2:" in out and "differ" not in out


def test_grpo_example(tmp_path):
    """examples/grpo.py (docs/generation.md): its mean reward rises over its 30 steps."""
    out = _torchrun("grpo.py", tmp_path)
    rewards = [float(line.split("mean reward ")[1].split()[0])
               for line in out.splitlines() if "mean reward" in line]
    assert len(rewards) == 6 and rewards[-1] > rewards[0], rewards
