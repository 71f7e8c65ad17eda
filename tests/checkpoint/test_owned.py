"""Nothing a user owns is touched, restarts are for what a restart cures, and a LoRA run
starts from an export as from the checkpoint it came from.

- Every writer (``zs.save``, ``zeroshard train``'s save folder, ``--profile`` and
  ``--tensorboard``, ``zeroshard export`` of weights and of a LoRA adapter) is run with a
  sentinel file of the user's beside and inside its target: the sentinels are there,
  byte for byte, afterwards; a target that holds a file of the user's where the writer
  would put its own is refused by name, and nothing in it changes. A writer replaces
  its own earlier output ([Note: a writer owns only what it wrote] in
  ``checkpoint/sanity.py``).
- A failure no restart can cure (a damaged checkpoint, found inside the ranks) ends a
  run with ``--max-restarts 3`` on its first attempt.
- ``--init-from`` an export with ``--lora`` trains exactly as ``--init-from`` the
  checkpoint it was exported from (the export's names are the base model's, peft's are
  prefixed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard._paths import RECORD
from zeroshard.checkpoint.consolidated import export
from zeroshard.cli import main
from zeroshard.models.gpt import GPT, get_preset
from zeroshard.runtime.spawn import spawn

MINE = b"the user's own, never to be touched\n"


def _sentinels(*folders: Path) -> dict[Path, str]:
    """A file of the user's in each folder (made if missing): path -> its sha256."""
    out = {}
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "notes-of-mine.txt"
        path.write_bytes(MINE)
        out[path] = hashlib.sha256(MINE).hexdigest()
    return out


def _intact(sentinels: dict[Path, str]) -> None:
    for path, digest in sentinels.items():
        assert path.is_file(), f"{path} was removed"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path} changed"


def test_zs_save_replaces_its_own_checkpoint_and_nothing_else(world, tmp_path):
    """A save beside the user's files (and the user's ``NAME.partial`` and ``NAME.old``
    folders, which a stopped save's clean-up used to remove or rename) leaves them; an
    overwrite replaces the earlier checkpoint; a target holding a user's file is refused
    before anything is written."""
    model = zs.shard(GPT(get_preset("tiny")), stage=3)
    opt = torch.optim.AdamW(model.parameters())
    mine = _sentinels(tmp_path, tmp_path / "other.partial", tmp_path / "other.old")
    zs.save(model, opt, tmp_path / "ckpt")
    zs.save(model, opt, tmp_path / "ckpt")  # its own earlier checkpoint: replaced
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "manifest.json", "rank00000.safetensors"]
    _intact(mine)
    inside = _sentinels(tmp_path / "ckpt")
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(ValueError, match="holds notes-of-mine.txt, which no zeroshard"):
        zs.save(model, opt, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    with pytest.raises(ValueError, match="is a file, not a checkpoint folder"):
        zs.save(model, opt, tmp_path / "notes-of-mine.txt")
    assert not (tmp_path / "notes-of-mine.txt.old").exists()
    _intact({**mine, **inside})
    assert zs.load(model, opt, tmp_path / "ckpt") == {}  # the checkpoint stayed whole


def test_the_trainer_and_exports_leave_the_users_files(tmp_path, capfd):
    """One ``zeroshard train`` launch writing checkpoints (pruned by --keep-last), a
    profile and TensorBoard scalars into folders that hold the user's files, then exports
    of its checkpoint: every sentinel stays; a folder of the user's inside the save
    folder, named as no step this run saves, stays too."""
    save, prof, board, out = (tmp_path / n for n in ("save", "profile", "board", "out"))
    mine = _sentinels(tmp_path, save, prof, board, out, save / "step-000099")
    assert main(["train", "--nproc", "1", "--model", "tiny", "--steps", "3", "--batch", "2",
                 "--sample-chars", "0", "--eval-every", "3", "--save-dir", str(save),
                 "--save-every", "1", "--keep-last", "1", "--profile", str(prof),
                 "--tensorboard", str(board)]) == 0
    _intact(mine)
    assert sorted(p.name for p in save.iterdir()) == [
        "latest", "notes-of-mine.txt", "step-000003", "step-000099"]
    assert RECORD in {p.name for p in prof.iterdir()}
    assert main(["train", "--nproc", "1", "--model", "tiny", "--steps", "4", "--batch", "2",
                 "--sample-chars", "0", "--eval-every", "4", "--profile", str(prof)]) == 0
    _intact(mine)  # a second profile replaces the first's files, which it recorded
    for argv in (["export", str(save), str(out)],
                 ["export", str(save), str(out), "--dtype", "bf16"]):  # its own: replaced
        assert main(argv) == 0
        _intact(mine)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_bytes(MINE)
    capfd.readouterr()
    assert main(["export", str(save), str(tmp_path / "theirs")]) == 2
    assert "holds model.safetensors, which zeroshard did not write" in capfd.readouterr().err
    assert (tmp_path / "theirs" / "model.safetensors").read_bytes() == MINE
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == ["model.safetensors"]


def test_an_incurable_failure_is_not_restarted(tmp_path, capfd):
    """A damaged checkpoint, found inside the ranks, with --max-restarts 3: the ranks'
    error once per rank (--debug prints every rank's traceback), then the one line;
    four attempts would print it eight times."""
    spawn(_train_once, 1, str(tmp_path), timeout=120)
    rank0 = tmp_path / "step-000002" / "rank00000.safetensors"
    with open(rank0, "r+b") as f:
        f.truncate(rank0.stat().st_size // 2)
    capfd.readouterr()
    code = main(["train", "--nproc", "2", "--model", "tiny", "--steps", "4", "--batch", "2",
                 "--sample-chars", "0", "--eval-every", "2", "--save-dir", str(tmp_path),
                 "--resume", "auto", "--max-restarts", "3", "--debug"])
    err = capfd.readouterr().err
    assert code == 2
    assert err.count("(truncated?)") == 2 + 1, err[-3000:]  # two ranks' tracebacks, the line
    assert "will restart worker group" not in err


def _train_once(folder: str) -> None:
    from zeroshard.train.loop import train
    from zeroshard.train.settings import TrainConfig

    train(TrainConfig(nproc=1, model="tiny", steps=2, batch=2, eval_every=2, eval_batches=1,
                      sample_chars=0, save_dir=folder))


def _lora_from(folder: str) -> dict[str, torch.Tensor]:
    """On every rank: the same LoRA run twice, from the export and from the checkpoint
    it was exported from; rank 0 returns both runs' full weights."""
    from zeroshard.train.loop import train
    from zeroshard.train.settings import TrainConfig

    weights = {}
    for source in ("export", "ckpt"):
        save = Path(folder) / f"lora-from-{source}"
        train(TrainConfig(nproc=2, model="tiny", steps=3, batch=4, eval_every=3,
                          eval_batches=1, sample_chars=0, lora=4, save_dir=str(save),
                          init_from=str(Path(folder) / source)))
        weights[source] = _master(save / "step-000003")
    return weights if dist.get_rank() == 0 else {}


def _master(ckpt: Path) -> dict[str, torch.Tensor]:
    from zeroshard.checkpoint.consolidated import reader

    manifest, assemble, _ = reader(ckpt, "fp32")
    return {n: assemble(n, tuple(p["shape"])) for n, p in manifest["params"].items()}


@pytest.mark.dist
def test_lora_from_an_export_is_lora_from_its_checkpoint(tmp_path):
    """``--init-from EXPORT --lora 4`` (which looked for peft's prefixed names in the
    export) trains bit for bit as ``--init-from CKPT --lora 4`` at N = 2: the same base
    weights, the adapters initialised alike."""
    spawn(_train_once, 1, str(tmp_path / "ckpt"), timeout=120)
    export(tmp_path / "ckpt", tmp_path / "export")
    got = spawn(_lora_from, 2, str(tmp_path), timeout=240)[0]
    a, b = got["export"], got["ckpt"]
    assert sorted(a) == sorted(b) and any(".lora_" in n for n in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    base = _master(tmp_path / "ckpt" / "step-000002")
    assert a["base_model.model.blocks.0.q.lora_B.default.weight"].abs().sum() > 0  # trained
    assert torch.equal(a["base_model.model.wte.weight"], base["wte.weight"])  # frozen base
