"""Checkpoints of other programs, recognised where a zeroshard checkpoint was asked for,
so the error names what the folder is and the command that converts it (pure paths: the
readers themselves live in ``checkpoint/deepspeed/``)."""

from __future__ import annotations

from pathlib import Path


def tag_folder(path: str | Path, tag: str | None = None) -> Path | None:
    """The folder of DeepSpeed files that ``path`` (a save folder with ``latest``, or a tag
    folder itself) names, or None when ``path`` does not look like a DeepSpeed save."""
    path = Path(path)
    if tag is not None:
        return path / tag
    if any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        named = path / latest.read_text().strip()
        if any(named.glob("*_model_states.pt")) or any(named.glob("*_optim_states.pt")):
            return named
    return None


def refuse_deepspeed(path: Path) -> None:
    """Where a zeroshard checkpoint was asked for: a DeepSpeed save (its ``latest`` names a
    tag folder, not a manifest) is named as one, with the command that converts it."""
    folder = tag_folder(path)
    if folder is not None:
        raise ValueError(f"{path} is a DeepSpeed checkpoint ({folder.name}), not a zeroshard "
                         f"one: convert it once with `zeroshard import-deepspeed {path} OUT` and "
                         "load OUT (zs.load), or `zeroshard export` OUT for --init-from")


def refuse_foreign(path: Path) -> None:
    """Where a zeroshard checkpoint was asked for: another program's folder (DeepSpeed's,
    torch.distributed.checkpoint's, a folder of safetensors or torch weights) is named as
    what it is, with what zeroshard does with it."""
    refuse_deepspeed(path)
    if path.is_dir() and (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        raise ValueError(f"{path} is a torch.distributed.checkpoint folder (.metadata, "
                         "*.distcp), not a zeroshard checkpoint; zeroshard reads its own, "
                         "DeepSpeed's (zeroshard import-deepspeed) and safetensors weights "
                         "(--init-from, zs.load_pretrained)")
    weights = [n for n in ("model.safetensors", "model.safetensors.index.json")
               if (path / n).is_file()] if path.is_dir() else (
        [path.name] if path.suffix == ".safetensors" else [])
    if weights:
        raise ValueError(f"{path} holds weights ({weights[0]}), not a zeroshard checkpoint: "
                         "start from them with --init-from (zs.load_pretrained)")
    torch_files = [n for n in ("pytorch_model.bin", "model.pt", "checkpoint.pt")
                   if (path / n).is_file()] if path.is_dir() else (
        [path.name] if path.suffix in (".pt", ".pth", ".bin") else [])
    if torch_files:
        raise ValueError(f"{path} holds torch.save weights ({torch_files[0]}), not a zeroshard "
                         "checkpoint: save them as safetensors and start from them with "
                         "--init-from (zs.load_pretrained)")
