"""Checkpoints on real gloo ranks: resume bit for bit, reshard across N and stages,
survive a rank killed mid-save, refuse damaged files, export to Hugging Face, import."""

import hashlib
import json
import os
import shutil
import signal

import pytest
import torch

import zeroshard as zs
from zeroshard.cli import main
from zeroshard.runtime.spawn import RankFailure, spawn

from ..engine import engine_cases as cases

pytestmark = pytest.mark.dist


def _steps(net, opt, a, b, model="gpt"):
    for s in range(a, b):
        x, y = cases.batch(model, s)
        net(x, y).backward()
        net.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()


def _make(stage, precision=None, model="gpt"):
    net = zs.shard(cases.build(model), stage=stage, mixed_precision=precision)
    return net, cases.make_optimizer("groups", net.named_parameters(), 1e-3)


def _save_then_continue(root, stage, precision):
    """Train 3 steps, save, train 3 more: the uninterrupted reference."""
    net, opt = _make(stage, precision)
    _steps(net, opt, 0, 3)
    zs.save(net, opt, os.path.join(root, "step-3"), extra={"step": 3})
    _steps(net, opt, 3, 6)
    return net.full_state_dict()


def _resume(root, stage, precision):
    net, opt = _make(stage, precision)
    extra = zs.load(net, opt, root)
    _steps(net, opt, extra["step"], 6)
    return net.full_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, n, stage, precision in (("n2s3", 2, 3, None), ("n4s0", 4, 0, None),
                                      ("bf16", 2, 3, "bf16")):
        (root / name).mkdir()
        out[name] = (root / name, spawn(_save_then_continue, n, str(root / name), stage,
                                        precision)[0])
    return out


def test_resume_same_n_and_stage_is_bit_for_bit(saved):
    for name, stage, precision in (("n2s3", 3, None), ("bf16", 3, "bf16")):
        root, ref = saved[name]
        assert cases.bit_equal(spawn(_resume, 2, str(root), stage, precision)[0], ref)


@pytest.mark.parametrize("name,n,stage", [("n2s3", 3, 1), ("n4s0", 2, 3), ("n2s3", 1, 0),
                                          ("n4s0", 3, 2)])
def test_resume_at_another_n_and_stage(saved, name, n, stage):
    root, ref = saved[name]
    assert cases.max_rel_diff(spawn(_resume, n, str(root), stage, None)[0], ref) < 1e-6


def _kill_mid_save(root):
    """Rank 1 dies (SIGKILL) half-way through writing its file of the second save."""
    import torch.distributed as dist

    import zeroshard.checkpoint.sharded as sharded

    net, opt = _make(3)
    _steps(net, opt, 0, 2)
    if dist.get_rank() == 1:
        real = sharded.write_tensors

        def dying(path, entries, metadata=None):
            entries = list(entries)
            real(path, entries[: len(entries) // 2], metadata)
            os.kill(os.getpid(), signal.SIGKILL)

        sharded.write_tensors = dying
    zs.save(net, opt, os.path.join(root, "step-2"), extra={"step": 2})


def _load_latest(root):
    net, opt = _make(3)
    extra = zs.load(net, opt, root)
    return extra["step"], net.full_state_dict()


def test_sigkill_during_save_keeps_the_last_checkpoint(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved["n2s3"][0], root)
    with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
        spawn(_kill_mid_save, 2, str(root), timeout=60)
    assert (root / "latest").read_text().strip() == "step-3"
    assert not (root / "step-2").exists() and (root / "step-2.partial").exists()
    step, _ = spawn(_load_latest, 2, str(root))[0]
    assert step == 3


def test_kill_between_the_renames_of_an_overwrite_leaves_latest_loadable(saved, tmp_path):
    """An overwrite moves the old copy aside, then the new one in: stopped between the
    two, ``latest`` names a folder that is gone while ``<name>.old`` is complete."""
    root = tmp_path / "run"
    shutil.copytree(saved["n2s3"][0], root)
    shutil.copytree(root / "step-3", root / "step-3.partial")  # the new copy, not moved in
    os.replace(root / "step-3", root / "step-3.old")
    assert (root / "latest").read_text().strip() == "step-3"
    step, weights = spawn(_load_latest, 2, str(root))[0]
    assert step == 3
    assert main(["inspect", str(root)]) == 0
    spawn(_mlp_save, 2, str(root))  # the next save clears up what the stopped one left
    assert sorted(p.name for p in root.iterdir()) == ["latest", "mlp", "step-3"]


def _try_load(path, model):
    net, opt = _make(3, model=model)
    before = net.full_state_dict()
    try:
        zs.load(net, opt, path)
        return None
    except ValueError as exc:
        unchanged = cases.bit_equal(net.full_state_dict(), before)
        return str(exc), unchanged


def _damage(root, how):
    ckpt = root / "step-3"
    f = ckpt / "rank00001.safetensors"
    if how == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "corrupted":
        data = bytearray(f.read_bytes())
        data[-50] ^= 0xFF
        f.write_bytes(bytes(data))
    elif how == "missing":
        f.unlink()
    elif how == "header":  # a tensor renamed in the header, the checksum made to match
        data = bytearray(f.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        name = next(k for k in header if k != "__metadata__" and "::" not in k)
        renamed = name[:-1] + ("X" if name[-1] != "X" else "Y")
        data[8:8 + n] = data[8:8 + n].replace(f'"{name}"'.encode(), f'"{renamed}"'.encode(), 1)
        f.write_bytes(bytes(data))
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"][f.name]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how,message", [
    ("truncated", "bytes, the manifest says"),
    ("corrupted", "checksum mismatch (corrupted)"),
    ("missing", "missing"),
    ("header", "which its manifest lists"),
])
def test_damaged_checkpoints_are_refused(saved, tmp_path, how, message):
    root = tmp_path / "run"
    shutil.copytree(saved["n2s3"][0], root)
    _damage(root, how)
    results = spawn(_try_load, 2, str(root), "gpt")
    for msg, unchanged in results:  # every rank refuses, nothing applied
        assert "step-3/rank00001.safetensors: " in msg and message in msg
        assert unchanged
    assert main(["inspect", str(root)]) == 1


def test_checkpoint_of_another_model_is_refused(saved):
    msg, unchanged = spawn(_try_load, 2, str(saved["n2s3"][0]), "mlp")[0]
    assert "checkpoint of a different model" in msg and unchanged


def test_inspect(saved, capsys):
    assert main(["inspect", str(saved["n4s0"][0])]) == 0
    out = capsys.readouterr().out
    assert "step 3, N = 4, ZeRO stage 0, recipe fp32-adamw" in out
    assert out.count(" ok ") == 4


def _hf_train(root):
    """Train a Hugging Face GPT-2 sharded at stage 3; save; return its logits."""
    lm = cases._hf("gpt2").lm
    net = zs.shard(lm, stage=3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for s in range(3):
        x, _ = cases.batch("gpt", s)
        net(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    zs.save(net, opt, os.path.join(root, "hf"), extra={"step": 3})
    x, _ = cases.batch("gpt", 99)
    with torch.no_grad():
        return net(input_ids=x, use_cache=False).logits, lm.config.to_dict()


def _import(path):
    net = zs.shard(cases._hf("gpt2").lm, stage=3)
    zs.load_pretrained(net, path)
    return net.full_state_dict()


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    import transformers

    logits, config = spawn(_hf_train, 2, str(tmp_path), timeout=300)[0]
    for out, size in ((tmp_path / "one", "5GB"), (tmp_path / "split", "20KB")):
        assert main(["export", str(tmp_path / "hf"), str(out), "--max-shard-size", size]) == 0
        transformers.GPT2Config.from_dict(config).save_pretrained(out)
        model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
        x, _ = cases.batch("gpt", 99, rank=0, world=2)
        with torch.no_grad():
            ref = model(input_ids=x, use_cache=False).logits
        assert torch.allclose(ref, logits, atol=1e-6, rtol=0), (ref - logits).abs().max()
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    # and back into a sharded model at another N, each rank reading its own rows
    weights = spawn(_import, 3, str(tmp_path / "split"))[0]
    from safetensors.torch import load_file

    exported = {}
    for f in set(index["weight_map"].values()):
        exported.update(load_file(tmp_path / "split" / f))
    assert all(torch.equal(weights[k], exported[k]) for k in exported if k in weights)


@pytest.mark.slow  # two launches; the engine's resharding: test_resume_at_another_n_and_stage
def test_trainer_resumes_at_another_nproc_and_stage(tmp_path):
    base = ["train", "--model", "tiny", "--steps", "12", "--eval-every", "100",
            "--sample-chars", "0", "--save-dir"]
    assert main([*base, str(tmp_path / "a"), "--save-every", "6", "--json-log",
                 str(tmp_path / "a.jsonl")]) == 0
    assert (tmp_path / "a" / "latest").read_text().strip() == "step-000012"
    assert main([*base, str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "step-000006"),
                 "--nproc", "1", "--stage", "1", "--json-log", str(tmp_path / "b.jsonl")]) == 0
    full = [json.loads(x)["loss"] for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    resumed = [json.loads(x)["loss"] for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert len(full) == 12 and len(resumed) == 6
    assert max(abs(a - b) for a, b in zip(full[6:], resumed)) < 1e-5


@pytest.mark.slow  # three launches; --init-from also in test_clear_errors (main tier)
def test_trainer_init_from_an_export(tmp_path):
    base = ["train", "--model", "tiny", "--eval-every", "100", "--sample-chars", "0"]
    assert main([*base, "--steps", "8", "--save-dir", str(tmp_path / "a"), "--json-log",
                 str(tmp_path / "a.jsonl")]) == 0
    assert main(["export", str(tmp_path / "a"), str(tmp_path / "hf")]) == 0
    assert main([*base, "--steps", "1", "--lr", "1e-12", "--nproc", "1", "--init-from",
                 str(tmp_path / "hf"), "--json-log", str(tmp_path / "b.jsonl")]) == 0
    trained = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[-1])["val_loss"]
    started = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert abs(trained - started) < 1e-5


def _mlp_save(root):
    """Saved at N = 3, then loaded into a fresh model by the same ranks."""
    net, opt = _make(3, model="mlp")
    _steps(net, opt, 0, 2, model="mlp")
    zs.save(net, opt, os.path.join(root, "mlp"), extra={"step": 2})
    return net.full_state_dict(), _mlp_load(root)


def _mlp_load(root):
    net, opt = _make(3, model="mlp")
    zs.load(net, opt, os.path.join(root, "mlp"))
    return net.full_state_dict()


def test_fewer_rows_than_ranks(tmp_path):
    # the MLP's head has 2 rows: at N = 3 one rank holds none of them
    saved, loaded = spawn(_mlp_save, 3, str(tmp_path))[0]
    assert cases.bit_equal(loaded, saved)
    assert cases.bit_equal(spawn(_mlp_load, 2, str(tmp_path))[0], saved)


def test_a_manifest_missing_keys_is_named(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved["n2s3"][0], root)
    manifest = json.loads((root / "step-3" / "manifest.json").read_text())
    del manifest["params"]
    (root / "step-3" / "manifest.json").write_text(json.dumps(manifest))
    for msg, unchanged in spawn(_try_load, 2, str(root), "gpt"):
        assert "step-3/manifest.json: the manifest lacks ['params'] (damaged" in msg, msg
        assert unchanged


@pytest.mark.slow
def test_resuming_a_checkpoint_without_the_trainers_step_says_so(tmp_path, capfd):
    """A checkpoint the trainer did not write (zs.save without extra={"step": ...})."""
    base = ["train", "--model", "tiny", "--steps", "2", "--eval-every", "100",
            "--sample-chars", "0"]
    assert main([*base, "--save-dir", str(tmp_path / "a")]) == 0
    manifest_path = tmp_path / "a" / "step-000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["extra"] = {}
    manifest_path.write_text(json.dumps(manifest))
    capfd.readouterr()
    assert main([*base, "--resume", str(tmp_path / "a" / "step-000002")]) != 0
    err = capfd.readouterr().err
    assert "was not saved by zeroshard train (no step and schedule); start from its " \
        "weights with --init-from after `zeroshard export`" in err  # found before launch
    assert err.count("\n") == 1, err
