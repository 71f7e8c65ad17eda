"""DeepSpeed checkpoints in: real DeepSpeed ZeRO-2 and ZeRO-3 runs (2 gloo ranks,
DS_ACCELERATOR=cpu, AdamW in two param groups, fp32 and bf16) write real checkpoints;
``import_deepspeed`` turns them into zeroshard checkpoints whose weights and Adam moments
equal DeepSpeed's own consolidation (zero_to_fp32 for the weights, ds_to_universal for the
moments) bit for bit, loaded at N = 1 and 4 and other stages; training on from them
matches torch DDP continuing from the consolidated state. Bad input is one line."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import zeroshard as zs
from zeroshard.checkpoint.deepspeed import import_deepspeed
from zeroshard.checkpoint.deepspeed.torchfile import Lazy, Opaque, read_structure
from zeroshard.checkpoint.load import _pieces
from zeroshard.checkpoint.sharded import entries, read_manifest, resolve
from zeroshard.checkpoint.tensorfile import TensorFile
from zeroshard.cli import main
from zeroshard.runtime.spawn import spawn

from ..engine import engine_cases as cases

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

#: name -> (model, DeepSpeed ZeRO stage, bf16): an odd-width MLP gives padded partitions,
#: the GPT a frozen parameter (wpe) and a tied one (head is wte); bf16 at stage 1 with fp32
#: gradient accumulation runs DeepSpeed's BF16_Optimizer, whose files differ (and two
#: configurations change DeepSpeed's order and grouping: see _write_deepspeed)
CONFIGS = {"gpt-z2-fp32": ("gpt_frozen_skip", 2, False), "mlp-z3-fp32": ("mlp_odd", 3, False),
           "mlp-z2-bf16": ("mlp_odd", 2, True), "gpt-z3-bf16": ("gpt_frozen_skip", 3, True),
           "mlp-z1-bf16": ("mlp_odd", 1, True), "mlp-z2-rr": ("mlp_odd", 2, False)}
#: ZeRO-2 with round_robin_gradients, whose flat buffer holds the parameters in another
#: order. There DeepSpeed's two consolidations disagree: ds_to_universal follows
#: param_slice_mappings, which DeepSpeed 0.19.8 builds in the original order
#: (stage_1_and_2.py _link_all_hp_params, utils/mixed_precision_linkage.py), zero_to_fp32
#: param_shapes, in the buffer's order. The weights DeepSpeed trains with (fp32 here) side
#: with zero_to_fp32, and so does the import; this configuration is checked against both.
ROUND_ROBIN = "mlp-z2-rr"
STEPS = 3  # DeepSpeed trains steps 0-2, then both sides steps 3-7 from its checkpoint


def _quiet_deepspeed():
    """Import DeepSpeed for CPU without what these tests do not use: its Muon optimizer
    (importing it compiles kernels, ~6 s a process: DeepSpeed's own comment in
    runtime/zero/stage_1_and_2.py average_tensor; it is only compared with by isinstance, so
    an empty class stands in) and its C++ shared-memory all-reduce (compiled on first use,
    for inference all-reduce only; gloo carries training's)."""
    import importlib
    import logging
    import types

    os.environ["DS_ACCELERATOR"] = "cpu"
    muon = types.ModuleType("deepspeed.runtime.zero.muon.muon_optimizer")
    muon.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    sys.modules.setdefault(muon.__name__, muon)
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.ERROR)
    return deepspeed


def _write_deepspeed(root: str):
    """Every configuration trained and saved by DeepSpeed; rank 0 returns DeepSpeed's own
    consolidation of each: zero_to_fp32's weights, ds_to_universal's moments and step."""
    import torch.distributed as dist

    deepspeed = _quiet_deepspeed()
    for name, (model_name, stage, bf16) in CONFIGS.items():
        model = cases.build(model_name)
        opt = cases.make_optimizer("groups", model.named_parameters(), 1e-3)
        config = {"train_micro_batch_size_per_gpu": cases.GLOBAL_BATCH // 2,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
                  "steps_per_print": 10**9}
        if stage == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if name == ROUND_ROBIN:
            config["zero_optimization"]["round_robin_gradients"] = True
        if name == "mlp-z3-fp32":  # many sub-groups per param group
            config["zero_optimization"]["sub_group_size"] = 64
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        for step in range(STEPS):
            batch = cases.batch(model_name, step)  # (DeepSpeed's bf16 casts no inputs)
            batch = [t.bfloat16() if bf16 and t.is_floating_point() else t for t in batch]
            engine.backward(engine(*batch))
            engine.step()
        engine.save_checkpoint(os.path.join(root, name))
        engine.destroy()
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    oracles = {}
    for name in CONFIGS:
        src, uni = Path(root, name), Path(root, "universal", name)
        if name == ROUND_ROBIN:  # the weights DeepSpeed trains with, beside zero_to_fp32's
            module = torch.load(src / f"global_step{STEPS}" / "mp_rank_00_model_states.pt",
                                weights_only=False)["module"]
            oracles[name] = (dict(get_fp32_state_dict_from_zero_checkpoint(str(src))), module)
            continue
        args = dict(input_folder=str(src / f"global_step{STEPS}"), output_folder=str(uni),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                    strict=True, inject_missing_state=True)
        ds_to_universal.main(type("Args", (), args)())
        state = {}
        for key in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            for p in (uni / "zero").iterdir():
                if (p / f"{key}.pt").exists():
                    t = torch.load(p / f"{key}.pt", weights_only=False)
                    state.setdefault(key, {})[p.name] = t["param"] if isinstance(t, dict) else t
        if CONFIGS[name][1] > 1:
            weights = dict(get_fp32_state_dict_from_zero_checkpoint(str(src)))
        else:  # zero_to_fp32 refuses BF16_Optimizer files; ds_to_universal reads them
            weights = state["fp32"]
        oracles[name] = (weights, state)
    return oracles


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    return root, spawn(_write_deepspeed, 2, str(root), timeout=300)[0]


def _assembled(ckpt: Path, key: str = "{}") -> dict:
    """Every parameter of a zeroshard checkpoint in full, from its rank files."""
    m = read_manifest(ckpt)
    out = {}
    for name, p in m["params"].items():
        if key != "{}" and not p["trainable"]:
            continue  # (no optimizer state)
        rows = p["shape"][0] if p["shape"] else 1
        parts = [TensorFile(str(ckpt / f)).rows(key.format(name), a, b)
                 for f, a, b, _, _ in _pieces(m, name, 0, rows)]
        out[name] = torch.cat(parts).reshape(p["shape"])
    return out


@needs_deepspeed
@pytest.mark.dist
def test_weights_and_moments_equal_deepspeeds_consolidation(written, tmp_path):
    root, oracles = written
    for k, name in enumerate(CONFIGS):
        weights, state = oracles[name]
        for world in (1, (3, 4, 2, 5, 4, 3)[k]):
            out = tmp_path / f"{name}-{world}"
            m = import_deepspeed(root / name, out, world=world)
            assert len(m["files"]) == world and m["extra"]["step"] == STEPS
            got = _assembled(out)
            assert [n for n, p in read_manifest(out)["params"].items()
                    if not p["trainable"]] == (["wpe.weight"] if "gpt" in name else [])
            tied = {"head.weight"} if CONFIGS[name][0].startswith("gpt") else set()
            assert set(got) == set(weights) - tied
            assert all(torch.equal(got[n], weights[n]) for n in got), name
            if name == ROUND_ROBIN:
                assert all(torch.equal(got[n], state[n]) for n in got)  # (state: module)
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                got = _assembled(out, "{}::" + key)
                assert got.keys() == state[key].keys()
                assert all(torch.equal(got[n].flatten(), state[key][n].flatten())
                           for n in got), (name, key)
            first = TensorFile(str(out / "rank00000.safetensors"))
            steps = [first.rows(k) for k in first.keys() if k.endswith("::step")]
            assert steps and all(float(s) == STEPS for s in steps)
            # (ds_to_universal keeps the step at stages 1-2 only)
            assert all(float(s) == STEPS for s in state.get("step", {}).values())


def _continue(ckpt: str, model_name: str, stage, precision, weights: dict, state: dict):
    """Load the import at this N and ``stage`` (checked against DeepSpeed's consolidation:
    the fp32 master in full, each rank's Adam rows) and train STEPS..STEPS+5; or, with
    stage "ddp", torch DDP from the consolidated weights and moments. Full weights after."""
    import torch.distributed as dist
    import torch.nn as nn

    model = cases.build(model_name)
    if stage == "ddp":
        model.load_state_dict(weights)
        net = nn.parallel.DistributedDataParallel(model)
        opt = cases.make_optimizer("groups", model.named_parameters(), 1e-3)
        for n, p in model.named_parameters():
            if n not in state["exp_avg"]:
                continue  # frozen
            opt.state[p] = {"step": torch.tensor(float(STEPS)),
                            **{k: state[k][n].reshape(p.shape).clone()
                               for k in ("exp_avg", "exp_avg_sq")}}
    else:
        net = zs.shard(model, stage=stage, mixed_precision=precision)
        opt = cases.make_optimizer("groups", net.named_parameters(), 1e-3)
        assert zs.load(net, opt, ckpt)["step"] == STEPS
        full = net.full_state_dict()
        assert all(torch.equal(full[n], w) for n, w in weights.items() if n in full)
        for e in entries(net):
            a, b = e.held()
            if a == b or not e.trainable:
                continue
            held = opt.state[e.shard]
            for k in ("exp_avg", "exp_avg_sq"):
                want = state[k][e.name].reshape(e.rows, -1)[a:b]
                assert torch.equal(held[k].reshape(-1, want.shape[1])[:b - a], want)
    for step in range(STEPS, STEPS + 5):
        net(*cases.batch(model_name, step)).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return (net.full_state_dict() if stage != "ddp"
            else {k: v.detach().clone() for k, v in model.state_dict().items()})


def _grid(jobs):
    return [_continue(*job) for job in jobs]


@needs_deepspeed
@pytest.mark.dist
def test_training_on_matches_ddp_at_another_n_and_stage(written, tmp_path):
    root, oracles = written
    jobs = {1: [], 4: []}
    # (N, zeroshard stage, config): fp32 against DDP; bf16 loaded and trained (no oracle)
    for n, stage, name in ((4, 1, "gpt-z2-fp32"), (4, 3, "mlp-z3-fp32"), (1, 0, "mlp-z3-fp32"),
                           (1, 3, "gpt-z2-fp32"), (4, 2, "gpt-z3-bf16"), (4, 0, "mlp-z2-bf16"),
                           (1, 2, "mlp-z1-bf16")):
        out = tmp_path / f"{name}-for-{n}-{stage}"
        import_deepspeed(root / name, out, world=3)
        model_name, _, bf16 = CONFIGS[name]
        weights, state = oracles[name]
        jobs[n].append((str(out), model_name, stage, "bf16" if bf16 else None, weights, state))
        if not bf16:
            jobs[n].append((str(out), model_name, "ddp", None, weights, state))
    for n, grid in jobs.items():
        results = spawn(_grid, n, grid, timeout=300)[0]
        for k, job in enumerate(grid):
            if job[2] == "ddp":
                # at N = 4 four ranks' sums meet in another order than DDP's buckets, and
                # AdamW carries the last bits on: 1.06e-6 measured for the GPT at stage 1
                tol = cases.TOL if n == 1 else 2 * cases.TOL
                assert cases.max_rel_diff(results[k - 1], results[k]) < tol, (n, job[:3])


@needs_deepspeed
@pytest.mark.dist  # (the DeepSpeed runs)
def test_an_interrupted_import_leaves_no_checkpoint(written, tmp_path, monkeypatch):
    from zeroshard.checkpoint.deepspeed import convert

    root, _ = written
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        return real(*args)

    real = convert.gather
    monkeypatch.setattr(convert, "gather", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError):
        import_deepspeed(root / "gpt-z2-fp32", out)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@needs_deepspeed
@pytest.mark.dist  # (the DeepSpeed runs)
def test_a_deepspeed_folder_where_a_zeroshard_checkpoint_is_asked_for(written, capsys):
    root, _ = written
    for path in (root / "gpt-z3-bf16", root / "gpt-z3-bf16" / "latest"):
        with pytest.raises(ValueError, match="DeepSpeed checkpoint .*import-deepspeed"):
            resolve(path)
    assert main(["inspect", str(root / "gpt-z3-bf16")]) == 2
    assert "zeroshard import-deepspeed" in capsys.readouterr().err


class _Stranger:
    """Pickled as a call to os.system: what a hostile checkpoint could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_torch_save_files_are_read_lazily_and_run_nothing(tmp_path):
    t = torch.arange(10, dtype=torch.bfloat16)
    marker = tmp_path / "ran"
    torch.save({"a": [t[2:], torch.zeros(2, 3)], "b": _Stranger(marker)}, tmp_path / "x.pt")
    s = read_structure(tmp_path / "x.pt")
    lazy = s["a"][0]
    assert isinstance(lazy, Lazy) and torch.equal(lazy.load(), t[2:])
    assert torch.equal(lazy.read(3, 5), t[5:7]) and s["a"][1].load().shape == (2, 3)
    assert isinstance(s["b"], Opaque) and not marker.exists()  # named, never called
    (tmp_path / "old.pt").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a zip archive"):
        read_structure(tmp_path / "old.pt")


def _fake(folder: Path, optim: dict, model: dict | None, ranks=(0,)):
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    for r in ranks:
        torch.save({"optimizer_state_dict": optim},
                   folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    if model is not None:
        torch.save(model, folder / "mp_rank_00_model_states.pt")


@pytest.mark.parametrize("case, message", [
    ("not deepspeed", "is not a DeepSpeed checkpoint: no `latest` file"),
    ("tag", "tag='global_step9': no folder"),
    ("out not empty", "out='.*' exists and is not empty"),
    ("stage 0", "not supported: .*ZeRO stage 0; stages 1, 2 and 3 are read"),
    ("no shapes", "a model-states file without param_shapes"),
    ("missing rank", "1 optimizer files for 2 ranks; missing ranks \\[1\\]"),
    ("world", "--world=0: expected a number of rank files >= 1"),
])
def test_bad_input_is_one_line(tmp_path, capsys, case, message):
    import re

    src, out, extra = tmp_path / "ds", tmp_path / "out", []
    good = {"zero_stage": 2, "partition_count": [2]}
    if case == "not deepspeed":
        src.mkdir()
    else:
        _fake(src / "global_step1", {**good, "zero_stage": 0} if case == "stage 0" else good,
              {"module": {}, "buffer_names": []}, ranks=(0,) if case == "missing rank"
              else (0, 1))
    if case == "tag":
        extra = ["--tag", "global_step9"]
    if case == "out not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    if case == "world":
        extra = ["--world", "0"]
    assert main(["import-deepspeed", str(src), str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert case == "out not empty" or not out.exists()
