"""Cases run on real gloo ranks: ``ZeroShardStrategy`` against ``strategy="ddp"`` on the
same LightningModule, data and seeds (gradient clipping, accumulation, a per-step
scheduler, decay groups by ``p.dim()``), checkpoints resumed by ``ckpt_path=``."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

from . import models as m


def _net():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        """Three repeated blocks (three units) between an input and a head."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                        for _ in range(3))
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": rest, "weight_decay": 0.0}], lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return [opt], [{"scheduler": sched, "interval": "step"}]

    return Net()


def loader(batch: int = 4):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def trainer(strategy, folder: str, **kw):
    import lightning.pytorch as pl

    import zeroshard.lightning  # noqa: F401 - registers "zeroshard" and its stages

    m.join_world()
    options = dict(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                   max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=folder, deterministic=True)
    return pl.Trainer(**{**options, **kw})


def fit(strategy, folder: str, ckpt_path=None, batch: int = 4, **kw):
    t = trainer(strategy, folder, **kw)
    model = _net()
    t.fit(model, loader(batch), loader(batch), ckpt_path=ckpt_path)
    return t, model


def _weights(t, model) -> dict:
    sharded = getattr(t.strategy, "sharded", None)
    if sharded is not None:
        return sharded.full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        results[name] = {"error": traceback.format_exc()[-4000:]}


def stages(folder: str, grid: tuple) -> dict:
    t, model = fit("ddp", folder)
    ref = _weights(t, model)
    out = {"ddp_val": float(t.callback_metrics["val_loss"])}
    for stage in grid:
        t, model = fit(f"zeroshard_stage_{stage}", folder)
        out[stage] = {"weights": m.weights_diff(_weights(t, model), ref),
                      "val": float(t.callback_metrics["val_loss"])}
    return out


def checkpoints(folder: str) -> dict:
    """Checkpoints at the end of each epoch (ModelCheckpoint); the first resumed by
    ``ckpt_path=`` at the same stage and at another; ``trainer.save_checkpoint`` and a
    ``validate`` from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    run = os.path.join(folder, "ck")
    t, model = fit("zeroshard_stage_3", folder, enable_checkpointing=True,
                   callbacks=[ModelCheckpoint(dirpath=run, save_top_k=-1, every_n_epochs=1)])
    end = _weights(t, model)
    first = os.path.join(run, sorted(os.listdir(run))[0])
    out = {"saved": sorted(os.listdir(run)), "inside": sorted(os.listdir(first))}
    for stage in (3, 1):
        t, model = fit(f"zeroshard_stage_{stage}", folder, ckpt_path=first)
        out[stage] = m.weights_diff(_weights(t, model), end)
    manual = os.path.join(folder, "manual.ckpt")
    t.save_checkpoint(manual)
    v = trainer("zeroshard_stage_2", folder)
    val = v.validate(_net(), loader(), ckpt_path=manual, verbose=False)[0]["val_loss"]
    out["manual"] = sorted(os.listdir(manual))
    out["validate"] = (val, float(t.callback_metrics["val_loss"]))
    return out


def bf16(folder: str) -> dict:
    """precision="bf16-mixed": the engine's bf16 recipe under bf16 autocast, against DDP's
    autocast over fp32 weights (other roundings: close, not equal)."""
    out = {}
    for strategy in ("ddp", "zeroshard"):
        t, model = fit(strategy, folder, precision="bf16-mixed")
        out[strategy] = float(t.callback_metrics["val_loss"])
        if strategy == "zeroshard":
            out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
            out["recipe"] = t.strategy.sharded.zero_config.recipe.name
    return out


def names(folder: str) -> dict:
    """The registered names: each gives the strategy at its stage."""
    from lightning.pytorch.strategies import StrategyRegistry

    import zeroshard.lightning  # noqa: F401

    return {n: StrategyRegistry[n]["init_params"].get("stage") for n in StrategyRegistry
            if n.startswith("zeroshard")}


def main_grid(folder: str) -> dict:
    results: dict = {}
    _run(results, "stages", stages, folder, (1, 3))
    _run(results, "checkpoints", checkpoints, folder)
    _run(results, "bf16", bf16, folder)
    _run(results, "names", names, folder)
    return results


def save_for_another_world(folder: str) -> dict:
    """At N = 2, batches of 4: 2 epochs, a checkpoint at each epoch's end."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    run = os.path.join(folder, "worlds")
    t, model = fit("zeroshard_stage_3", folder, enable_checkpointing=True,
                   callbacks=[ModelCheckpoint(dirpath=run, save_top_k=-1, every_n_epochs=1)])
    return {"end": _weights(t, model), "first": os.path.join(run, sorted(os.listdir(run))[0])}


def resume_in_another_world(folder: str, ckpt: str, stage: int) -> dict:
    """At N = 1, batches of 8 (the same 8 samples a step as N = 2's two batches of 4),
    from the N = 2 run's first checkpoint."""
    t, model = fit(f"zeroshard_stage_{stage}", folder, ckpt_path=ckpt, batch=8)
    return {"end": _weights(t, model)}
