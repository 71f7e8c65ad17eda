"""``zeroshard train --tensorboard DIR``: the run's scalars as TensorBoard event files,
written on rank 0 by torch's ``SummaryWriter``.

Tags, each against the optimizer step: ``train/loss`` (the step's mean loss over
ranks), ``train/lr``, ``train/tokens_per_s``, ``train/grad_norm`` (before clipping;
absent with --clip 0), ``train/skipped_steps`` (steps skipped for non-finite gradients
so far), ``eval/train_loss`` and ``eval/val_loss`` at each evaluation (the
validation loss also before the first step), and
``memory/<category>`` (bytes rank 0 holds at the optimizer step: params, grads,
optimizer, padding, gathered, buffers, as the ledger counts them).
"""

from __future__ import annotations

from .optimizer import each

PACKAGE = "tensorboard"


def check(folder_path: str) -> None:
    """Before launch: the package is importable and the folder takes writes."""
    from .._paths import folder

    try:
        import tensorboard  # noqa: F401 - SummaryWriter needs it, and says so late
    except ImportError:
        raise ValueError(f"tensorboard={folder_path!r} needs the {PACKAGE} package, which is "
                         f"not installed; pip install {PACKAGE} (or zeroshard[hf])") from None
    folder("tensorboard", folder_path)


class Board:
    """Rank 0's writer; every method is a no-op elsewhere or without ``--tensorboard``."""

    def __init__(self, folder_path: str | None, enabled: bool, purge_step: int | None = None):
        self.writer, self.held = None, {}
        if folder_path and enabled:
            check(folder_path)
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run replaces what a stopped one wrote from its checkpoint's step on
            # (start() writes that step's evaluation again)
            self.writer = SummaryWriter(folder_path, purge_step=purge_step)

    def start(self, val_loss: float, step: int) -> None:
        """The evaluation before training (or at the step resumed), where the curve starts."""
        if self.writer is not None:
            self.writer.add_scalar("eval/val_loss", val_loss, step)

    def watch(self, model, optimizer) -> None:
        """Read memory by category at every optimizer step, where every category is live
        (after backward, the reductions landed)."""
        if self.writer is not None:
            first = each(optimizer)[0]  # Muon's pair: read once, for both
            first.register_step_pre_hook(
                lambda o, a, k: self.held.update(model.memory(optimizer)))

    def step(self, record: dict, skipped_total: int) -> None:
        if self.writer is None:
            return
        w, step = self.writer, record["step"]
        for category, nbytes in self.held.items():
            w.add_scalar(f"memory/{category}", nbytes, step)
        w.add_scalar("train/loss", record["loss"], step)
        w.add_scalar("train/lr", record["lr"], step)
        w.add_scalar("train/tokens_per_s", record["tokens_per_s"], step)
        if record["grad_norm"] is not None:
            w.add_scalar("train/grad_norm", record["grad_norm"], step)
        w.add_scalar("train/skipped_steps", skipped_total, step)
        for key in ("train_loss", "val_loss"):
            if key in record:
                w.add_scalar(f"eval/{key}", record[key], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
