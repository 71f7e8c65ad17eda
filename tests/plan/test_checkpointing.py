"""The activation model under each checkpointing mode held against the engine's profiler.

One process (a group of one) shards each family's model at stage 3 with
``profile=True`` and ``activation_checkpointing=MODE`` and runs a forward and a backward;
the profiler counts what a checkpoint holds (its inputs, selective checkpointing's kept
outputs, each recomputed tensor until backward uses it: ``runtime/checkpointing.py``).
The planner's figures for the same architecture, workload, dtype and mode must be
within 2 % of the saved bytes at the end of the forward and of their peak over the step
(the issue asks 5 %), for every family, in fp32 and bf16, with the flash kernel
(``sdpa``) and without it (``eager``); and the peak must fall as the mode keeps less.
"""

from __future__ import annotations

import pytest

from zeroshard.plan import ModelSpec, Workload, get_recipe
from zeroshard.plan.workload import activation_saved

from .test_activations import BUILTIN, MODELS, _arch

transformers = pytest.importorskip("transformers")

MODES = ("none", "full", "selective", 2, "full+offload")
SEQ, BATCH = 64, 2


def _cases(families) -> list[tuple]:
    out = []
    for name in families:
        attns = {"gemma2": ("eager",), "builtin-gpt": ("sdpa",)}.get(name, ("sdpa", "eager"))
        for attn in attns:
            for precision in ("fp32", "bf16"):
                out.append((name, attn, precision))
    return out


MAIN = _cases(("builtin-gpt", "llama", "gpt2"))
REST = _cases(("qwen2", "qwen3", "neox", "gemma2", "gpt2-gelu_new"))


def _measure(cases) -> dict:
    """{(case, mode): (saved at the end of the forward, their peak over the step, after
    the step)} and each case's config file."""
    import os
    import tempfile

    import torch

    import zeroshard as zs
    from zeroshard.models.gpt import GPT, GPTConfig

    transformers.logging.set_verbosity_error()
    out, folder = {}, tempfile.mkdtemp()
    for case in cases:
        name, attn, precision = case
        config = None
        if name != "builtin-gpt":
            cls, fields = MODELS[name]
            cfg = getattr(transformers, cls)(**fields, attn_implementation=attn)
            config = os.path.join(folder, f"{name}.json")
            with open(config, "w") as fh:
                fh.write(cfg.to_json_string())
        for mode in MODES:
            torch.manual_seed(0)
            if name == "builtin-gpt":
                model = GPT(GPTConfig(**BUILTIN))
                call = lambda net, x: net(x, x)  # noqa: E731
            else:
                model = transformers.AutoModelForCausalLM.from_config(cfg)
                call = lambda net, x: net(input_ids=x, labels=x, use_cache=False).loss  # noqa: E731
            net = zs.shard(model, stage=3, profile=True, activation_checkpointing=mode,
                           mixed_precision=None if precision == "fp32" else precision)
            loss = call(net, torch.randint(0, 256, (BATCH, SEQ)))
            forward = net.profiler.activation_bytes
            loss.backward()
            top = max(e.memory["activations"] for e in net.profiler.events)
            out[case, mode] = (forward, top, net.profiler.activation_bytes)
        out[case] = config
    return out


def _planned(case, config, mode) -> tuple[int, int]:
    name, attn, precision = case
    arch = _arch(name, config)
    work = Workload.of_mode(SEQ * BATCH, SEQ, mode, flash_attention=attn == "sdpa", cpu=True)
    recipe = get_recipe("fp32-adamw" if precision == "fp32" else "bf16-mixed-adamw")
    saved = activation_saved(ModelSpec.from_arch(arch), recipe, work)
    return saved.blocks + saved.head, saved.peak


def _check(measured, case) -> None:
    for mode in MODES:
        forward, top, after = measured[case, mode]
        plan_forward, plan_peak = _planned(case, measured[case], mode)
        assert after == 0, (mode, after)  # everything held is let go by the end
        assert plan_forward / forward - 1 == pytest.approx(0, abs=0.02), (mode, forward)
        assert plan_peak / top - 1 == pytest.approx(0, abs=0.02), (mode, top)
    peaks = {mode: measured[case, mode][1] for mode in MODES}
    assert peaks["full"] < peaks[2] < peaks["none"] and peaks["selective"] < peaks["none"]
    assert peaks["full"] < peaks["selective"]


@pytest.fixture(scope="module")
def measured():
    from zeroshard.runtime.spawn import spawn

    return spawn(_measure, 1, MAIN, timeout=600)[0]


@pytest.mark.parametrize("case", MAIN, ids="-".join)
def test_each_mode_within_2_percent(measured, case):
    _check(measured, case)


@pytest.mark.slow
def test_each_mode_within_2_percent_for_every_other_family():
    from zeroshard.runtime.spawn import spawn

    measured = spawn(_measure, 1, REST, timeout=900)[0]
    for case in REST:
        _check(measured, case)
