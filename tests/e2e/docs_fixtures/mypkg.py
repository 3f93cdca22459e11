"""The package the documents call ``mypkg``: docs/quickstart.md's regression model and data, as a user's own
package would hold them (the docs test puts this file beside each page's commands and on PYTHONPATH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import trainkit as tk


class Regressor(tk.TrainModule):
    def __init__(self, dim: int = 8, hidden: int = 64, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(n: int, dim: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class RegressionData(tk.DataModule):
    def __init__(self, n: int = 1024, dim: int = 8, batch_size: int = 32):
        self.n, self.dim, self.batch_size = n, dim, batch_size

    def setup(self, stage):
        data = make_data(self.n, self.dim)
        cut = self.n * 7 // 8
        self.train_set, self.val_set = Subset(data, range(cut)), Subset(data, range(cut, self.n))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def predict_dataloader(self):  # the validation inputs alone: Regressor's predict_step is self(batch)
        return DataLoader(make_data(self.n, self.dim).tensors[0][self.n * 7 // 8 :], batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


MyData = RegressionData
