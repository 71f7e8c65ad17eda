"""Lightning with ZeRO: ``strategy="zeroshard"`` (stage 3; ``"zeroshard_stage_1"`` etc., or
``ZeroShardStrategy(stage=K, ...)``) once ``zeroshard.lightning`` is imported.

Run: python examples/lightning_fit.py   (Lightning starts the second process itself)
Needs ``pip install 'zeroshard[lightning]'``. The checkpoints are folders: ``zeroshard/``
(every rank's rows, loadable at any number of ranks and stage) and ``meta.pt``.
"""

import lightning.pytorch as pl
import torch
import torch.nn as nn

import zeroshard.lightning  # noqa: F401 - registers strategy="zeroshard"


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU())
                                    for _ in range(4))  # one unit each
        self.head = nn.Linear(128, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):  # self.parameters() are this rank's shards here
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def loader(n, seed):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    y = x.sin().sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zeroshard", max_epochs=3,
                         gradient_clip_val=1.0, accumulate_grad_batches=2,
                         default_root_dir="runs/lightning", logger=False)
    trainer.fit(Regressor(), loader(2048, 1), loader(256, 2))
    trainer.save_checkpoint("runs/lightning/final.ckpt")  # every rank calls it
    if trainer.is_global_zero:
        print("val_loss", float(trainer.callback_metrics["val_loss"]))
