"""``zeroshard train --activation-checkpointing MODE --profile DIR``: the profile's plan is
the mode the engine runs. For the built-in GPT small (full in the main tier; every mode,
medium and a Hugging Face Llama in the slow tier), on 2 gloo ranks at stage 3: the
planned peak within 5 % of the measured (the issue's bound; they come out within 0.5 %),
the planner's activation peak within 5 % of the largest the trace records, and
checkpointing's activation peak measurably below keeping everything."""

from __future__ import annotations

import json
import re

import pytest

from zeroshard.cli import main

pytestmark = pytest.mark.dist

MB = 1e6


def _trace_peak(folder) -> float:
    """The most activation MB rank 0's trace records at any event."""
    trace = json.loads((folder / "trace-rank0.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return max(e["args"]["activations"] for e in events
               if e.get("ph") == "C" and "activations" in e.get("args", {}))


def _planned_activations(arch, seq: int, mode, loss_outside: bool) -> float:
    """The planner's activation peak in MB for 2 sequences of ``seq`` a rank, as the
    profiler counts it: the Hugging Face loss runs on the returned logits, outside its
    hooks (``Peak.unseen_loss``)."""
    from zeroshard.plan import ModelSpec, Workload, get_recipe
    from zeroshard.plan.activations import loss_bytes
    from zeroshard.plan.workload import activation_saved

    work = Workload.of_mode(2 * seq, seq, mode, flash_attention=True, cpu=True)
    s = activation_saved(ModelSpec.from_arch(arch), get_recipe("fp32-adamw"), work)
    head = s.head - (2 * seq * loss_bytes(arch) if loss_outside else 0)
    return (s.blocks + max(head, s.recompute + s.kept)) / MB


def _run(tmp_path, capfd, mode, arch, seq: int, *model: str) -> dict:
    folder = tmp_path / str(mode)
    assert main(["train", "--nproc", "2", *model, "--steps", "2", "--batch", "4",
                 "--activation-checkpointing", str(mode), "--profile", str(folder),
                 "--eval-every", "100", "--sample-chars", "0"]) == 0
    out = capfd.readouterr().out
    peak = re.search(r"│\s+peak │\s+([\d.]+) │\s+([\d.]+) │", out).groups()
    planned = _planned_activations(arch, seq, mode, model[0] == "--hf-model")
    return {"peak": (float(peak[0]), float(peak[1])), "planned": planned,
            "traced": _trace_peak(folder)}


def _gpt(preset: str):
    from zeroshard.models.gpt import get_preset
    from zeroshard.train.hfmodel import gpt_architecture

    config = get_preset(preset)
    return gpt_architecture(config), config.block_size


def _check(runs: dict) -> None:
    for mode, r in runs.items():
        planned, measured = r["peak"]
        assert planned / measured - 1 == pytest.approx(0, abs=0.05), (mode, r["peak"])
        assert r["planned"] / r["traced"] - 1 == pytest.approx(0, abs=0.05), (
            mode, r["planned"], r["traced"])
    none = runs["none"]["traced"]
    for mode in ("full", "selective"):
        assert runs[mode]["traced"] < 0.9 * none, (mode, runs[mode]["traced"], none)


@pytest.mark.slow  # a trainer launch; the engine's and the planner's tests are main
def test_small_gpt_full_as_planned(tmp_path, capfd):
    """One mode in the main tier (``tests/plan/test_checkpointing.py`` holds every mode's
    activations to the profiler there)."""
    arch, seq = _gpt("small")
    r = _run(tmp_path, capfd, "full", arch, seq, "--model", "small")
    assert r["peak"][0] / r["peak"][1] - 1 == pytest.approx(0, abs=0.05), r["peak"]
    assert r["planned"] / r["traced"] - 1 == pytest.approx(0, abs=0.05), r


@pytest.mark.slow
def test_small_gpt_each_mode_as_planned(tmp_path, capfd):
    arch, seq = _gpt("small")
    _check({m: _run(tmp_path, capfd, m, arch, seq, "--model", "small")
            for m in ("none", "full", "selective")})


@pytest.mark.slow
def test_medium_gpt_every_mode_as_planned(tmp_path, capfd):
    arch, seq = _gpt("medium")
    _check({m: _run(tmp_path, capfd, m, arch, seq, "--model", "medium")
            for m in ("none", "full", "selective", 2, "full+offload")})


@pytest.mark.slow
def test_hf_llama_every_mode_as_planned(tmp_path, tmp_path_factory, capfd):
    from zeroshard.plan import from_hf_config

    from .test_hf import _models

    root = tmp_path_factory.mktemp("models")
    _models(root)
    arch = from_hf_config(root / "llama" / "config.json")
    _check({m: _run(tmp_path, capfd, m, arch, 64, "--hf-model",  # its longest sequence
                    str(root / "llama")) for m in ("none", "full", "selective", 2,
                                                   "full+offload")})
