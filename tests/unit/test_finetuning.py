"""BaseFinetuning's helpers against Lightning's, param groups added mid-run (kept in checkpoints under ``single``,
refused with what can take them by the strategies that plan by the groups), and a MultiStepLR that keeps decaying
after a resume. One process each; the 2-rank runs are tests/e2e/test_finetuning.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainkit as tk
from tests.helpers import loader, regression_data
from trainkit.callbacks import BaseFinetuning, Callback
from trainkit.errors import ConfigurationError

SHARDED = ["zero1", "zero2", "zero_offload", "zero3", "fsdp"]


def backbone() -> nn.Module:
    """Nested modules, a BatchNorm in each part and a module with parameters of its own beside its children."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    inner.register_parameter("scale", nn.Parameter(torch.ones(4)))
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4, bias=False), nn.BatchNorm1d(4), nn.ReLU()), inner,
                         nn.ModuleDict({"head": nn.Linear(4, 2)}))


def flags(model: nn.Module) -> tuple[dict[str, bool], dict[str, bool]]:
    return ({n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.track_running_stats for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)})


@pytest.mark.parametrize("train_bn", [True, False])
def test_the_helpers_do_what_lightnings_do(train_bn):
    """freeze, flatten_modules, filter_params, make_trainable and unfreeze_and_add_param_group leave the same
    requires_grad and BatchNorm tracking on every parameter and module, and add the same group, as Lightning's."""
    lightning = pytest.importorskip("pytorch_lightning.callbacks.finetuning").BaseFinetuning
    ours, theirs = backbone(), backbone()
    BaseFinetuning.freeze(ours, train_bn=train_bn)
    lightning.freeze(theirs, train_bn=train_bn)
    assert flags(ours) == flags(theirs)
    assert not all(flags(ours)[0].values())
    position = {p: i for i, p in enumerate(ours.parameters())}
    position |= {p: i for i, p in enumerate(theirs.parameters())}
    assert [position[p] for p in BaseFinetuning.filter_params(ours, train_bn)] == \
        [position[p] for p in lightning.filter_params(theirs, train_bn)]
    assert [type(m) for m in BaseFinetuning.flatten_modules([ours[0], ours[2]])] == \
        [type(m) for m in lightning.flatten_modules([theirs[0], theirs[2]])]
    groups = []
    for model, cls in ((ours, BaseFinetuning), (theirs, lightning)):
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
        cls.unfreeze_and_add_param_group(model[1], optimizer, train_bn=train_bn)
        groups.append([([position[p] for p in g["params"]], g["lr"]) for g in optimizer.param_groups])
    assert flags(ours) == flags(theirs)
    assert groups[0] == groups[1] and len(groups[0]) == 2 and groups[0][1][1] == pytest.approx(0.01)


def test_a_parameter_already_in_the_optimizer_is_not_added_again():
    """By identity: Lightning compares values, so a parameter equal to one in the optimizer (two zero biases) was
    dropped too."""
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([a], lr=0.1)
    with pytest.warns(UserWarning, match="in the optimizer already"):
        assert BaseFinetuning.filter_on_optimizer(optimizer, [a, b]) == [b]


class Net(tk.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.features.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.features(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class AddGroup(Callback):
    def __init__(self, add: bool = True) -> None:
        self.add = add

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == 1:
            module.features.requires_grad_(True)
            if self.add:
                trainer.optimizer.add_param_group({"params": list(module.features.parameters()), "lr": 1e-3})


class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.features)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.features, optimizer)


def _fit(tmp_path, strategy: str, callbacks: list, max_epochs: int = 2, ckpt_path: str | None = None) -> tk.Trainer:
    trainer = tk.Trainer(strategy=strategy, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
                         num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=callbacks, seed=0)
    trainer.fit(Net(), loader(regression_data(16), 8, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def test_a_group_added_mid_run_is_saved_and_comes_back_on_resume(tmp_path):
    """Under ``single`` the save after ``add_param_group`` raised "zip() argument 2 is longer than argument 1"; the
    checkpoint now names the added group's parameters, and a resume re-creates the group (trainable, with its rate
    and its Adam state) before loading the optimizer."""
    from trainkit.checkpoint import CheckpointReader, latest

    _fit(tmp_path, "single", [AddGroup()])
    groups = CheckpointReader(latest(tmp_path / "checkpoints")).meta["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [["head.weight", "head.bias"], ["features.0.weight", "features.0.bias"]]
    assert groups[1]["lr"] == 1e-3
    resumed = _fit(tmp_path, "single", [], max_epochs=3, ckpt_path="last")
    added = resumed.optimizer.param_groups[1]
    assert added["lr"] == 1e-3 and all(p.requires_grad for p in added["params"])
    assert int(resumed.optimizer.state[added["params"][0]]["step"]) == 2 + 2  # 2 steps before the save, 2 after


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("add", [True, False], ids=["add_param_group", "unfreeze"])
def test_the_strategies_that_plan_by_the_groups_refuse_naming_what_can(tmp_path, strategy, add):
    """At the first backward after the change, not after epochs of training on gradients nobody reduces: a group
    added, or parameters frozen at setup given requires_grad again (under zero2 they had trained on nothing)."""
    with pytest.raises(ConfigurationError) as err:
        _fit(tmp_path, strategy, [AddGroup(add)])
    said = str(err.value)
    assert said.startswith(f"{strategy} cannot change what the optimizer trains after setup")
    assert ("add_param_group" if add else "features.0.weight, features.0.bias") in said
    assert "single and ddp" in said and "lr=0" in said


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_base_finetuning_is_refused_before_training_and_a_checkpoint_with_added_groups_too(tmp_path, strategy):
    with pytest.raises(ConfigurationError, match=f"{strategy} cannot change .* Unfreeze \\(a BaseFinetuning\\)"):
        _fit(tmp_path / "callback", strategy, [Unfreeze()])
    _fit(tmp_path / "saved", "single", [AddGroup()])
    with pytest.raises(ConfigurationError, match="the checkpoint holds 1 param group"):
        _fit(tmp_path / "saved", strategy, [], max_epochs=3, ckpt_path="last")


def test_a_multistep_schedule_keeps_decaying_after_a_resume(tmp_path):
    """meta.json stored MultiStepLR's milestones (a Counter of epochs) with string keys, so a resumed run never met a
    milestone again: Lightning's fine-tuning example kept its rate."""

    class Stepped(Net):
        def configure_optimizers(self) -> Any:
            optimizer = super().configure_optimizers()
            return [optimizer], [torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2], gamma=0.5)]

    def fit(max_epochs: int, ckpt_path: str | None = None) -> tk.Trainer:
        trainer = tk.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, seed=0,
                             default_root_dir=tmp_path)
        trainer.fit(Stepped(), loader(regression_data(16), 8), ckpt_path=ckpt_path)
        return trainer

    fit(1)
    assert fit(3, ckpt_path="last").optimizer.param_groups[0]["lr"] == 5e-3
