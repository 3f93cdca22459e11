"""What configure_optimizers may return (every form Lightning accepts, never a silent misreading), and manual
optimization on one process: the user's own accumulation, schedulers the user steps, checkpoints holding every
optimizer and scheduler, and the programs whose numbers trainkit could not reproduce refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import trainkit as tk
from tests.helpers import regression_data
from tests.parity.gan import DIM, GAN, _adversarial, gan_data, train_plain
from trainkit.errors import ConfigurationError
from trainkit.optim import parse_optimizers


def _trainer(tmp_path: Any, **kwargs: Any) -> tk.Trainer:
    defaults = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    return tk.Trainer(**(defaults | kwargs))


def test_every_form_lightning_accepts():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.Adam([b])
    sched_a, sched_b = torch.optim.lr_scheduler.StepLR(opt_a, 1), torch.optim.lr_scheduler.StepLR(opt_b, 2)
    assert parse_optimizers(opt_a).optimizers == [opt_a] and parse_optimizers(opt_a).scheduler is None
    assert parse_optimizers((opt_a, opt_b)).optimizers == [opt_a, opt_b]  # was read as (optimizer, scheduler)
    assert parse_optimizers([opt_a, opt_b]).optimizers == [opt_a, opt_b]
    config = parse_optimizers(([opt_a, opt_b], [sched_a, {"scheduler": sched_b, "interval": "step"}]))
    assert config.optimizers == [opt_a, opt_b]
    assert [(s.scheduler, s.interval) for s in config.schedulers] == [(sched_a, "epoch"), (sched_b, "step")]
    config = parse_optimizers([{"optimizer": opt_a, "lr_scheduler": sched_a},
                               {"optimizer": opt_b, "lr_scheduler": {"scheduler": sched_b, "frequency": 2}}])
    assert config.optimizers == [opt_a, opt_b] and config.schedulers[1].frequency == 2
    single = parse_optimizers({"optimizer": opt_a, "lr_scheduler": {"scheduler": sched_a, "interval": "step"}})
    assert (single.scheduler, single.schedulers[0].interval) == (sched_a, "step")
    assert parse_optimizers((opt_a, sched_a)).scheduler is sched_a  # trainkit's (optimizer, scheduler)


@pytest.mark.parametrize("value, match", [
    ((torch.optim.lr_scheduler.StepLR, 1), "cannot read"),
    ("adam", "cannot read"),
    ({"optimizer": "adam"}, "under 'optimizer'"),
    (None, "cannot read"),
])
def test_other_shapes_are_errors_listing_the_forms(value, match):
    with pytest.raises(ConfigurationError, match=match) as err:
        parse_optimizers(value)
    assert "a list or tuple of optimizers" in str(err.value)


def test_a_parameter_in_two_optimizers_and_a_foreign_scheduler_are_refused():
    a = nn.Parameter(torch.zeros(2))
    opt, other = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigurationError, match="in optimizers 0 and 1"):
        parse_optimizers([opt, torch.optim.Adam([a])])
    with pytest.raises(ConfigurationError, match="did not return"):
        parse_optimizers(([opt], [torch.optim.lr_scheduler.StepLR(other, 1)]))
    with pytest.raises(ConfigurationError, match="interval"):
        parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                             "interval": "hour"}})


class Scheduled(GAN):
    """The GAN with a StepLR per optimizer, stepped by the user every batch (manual optimization's rule)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        opt_g, opt_d = super().configure_optimizers()
        return ([opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.5),  # milestones: integer keys in JSON
                                 torch.optim.lr_scheduler.MultiStepLR(opt_d, [5, 11], 0.5)])


def test_checkpoints_hold_every_optimizer_and_scheduler(tmp_path):
    whole = Scheduled()
    _trainer(tmp_path / "whole", max_epochs=2).fit(whole, DataLoader(gan_data(), batch_size=8))
    first = _trainer(tmp_path / "cut", max_steps=6)
    first.fit(Scheduled(), DataLoader(gan_data(), batch_size=8))
    resumed = Scheduled()
    trainer = _trainer(tmp_path / "cut", max_epochs=2)
    trainer.fit(resumed, DataLoader(gan_data(), batch_size=8), ckpt_path=first.resolve_ckpt_path("last"))
    assert torch.equal(torch.stack(resumed.losses), torch.stack(whole.losses[3:]))
    assert [s.last_epoch for s in resumed.lr_schedulers()] == [s.last_epoch for s in whole.lr_schedulers()] == [16, 16]
    assert [g["lr"] for o in trainer.optimizers for g in o.param_groups] == \
        [g["lr"] for o in whole.trainer.optimizers for g in o.param_groups]


class Untoggled(GAN):
    """Both losses back-propagated into both models, each optimizer zeroed before its own backward (the plain PyTorch
    DCGAN's order) or, with ``zero_first=False``, not: the discriminator would then step on the generator loss's
    gradients too, which trainkit's window has released."""

    def __init__(self, zero_first: bool = True) -> None:
        super().__init__()
        self.zero_first = zero_first

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        opt_g.zero_grad()
        g_loss = _adversarial(self.discriminator(self(z)), real=True)
        self.manual_backward(g_loss)
        opt_g.step()
        if self.zero_first:
            opt_d.zero_grad()
        d_loss = (_adversarial(self.discriminator(real), True) + _adversarial(self.discriminator(self(z).detach()),
                                                                               False)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        self.losses.append(torch.stack([g_loss.detach(), d_loss.detach()]))


def test_gradients_released_by_another_step_are_never_silently_dropped(tmp_path):
    zeroed = Untoggled()
    _trainer(tmp_path, max_epochs=1).fit(zeroed, DataLoader(gan_data(), batch_size=8))
    plain = torch.stack(train_plain(8, 8))  # toggling or zeroing first: the same numbers
    torch.testing.assert_close(torch.stack(zeroed.losses), plain, rtol=1e-6, atol=1e-6)
    assert not any(p._post_accumulate_grad_hooks for p in zeroed.parameters())  # the fit took its hooks off
    with pytest.raises(ConfigurationError, match="another optimizer's step released"):
        _trainer(tmp_path / "kept", max_epochs=1).fit(Untoggled(zero_first=False),
                                                      DataLoader(gan_data(), batch_size=8))


class ClippedUntoggled(Untoggled):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.clip_gradients(self.optimizers()[0], gradient_clip_val=0.1)
        super().training_step(batch, batch_idx)


def test_clipping_with_another_optimizers_gradients_pending_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="toggle_optimizer"):
        _trainer(tmp_path, max_epochs=1).fit(ClippedUntoggled(), DataLoader(gan_data(), batch_size=8))


class Accumulating(tk.TrainModule):
    """One optimizer stepped every ``every`` batches by the user, as Lightning's manual accumulation."""

    def __init__(self, every: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.every = every
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(F.mse_loss(self.net(x), y) / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def test_accumulation_by_the_user_equals_the_plain_loop(tmp_path):
    module = Accumulating()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(module, DataLoader(regression_data(), batch_size=8))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(DataLoader(regression_data(), batch_size=8)):
        (F.mse_loss(net(x), y) / 2).backward()
        if (i + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
    assert trainer.global_step == 4  # steps taken, not batches
    for got, want in zip(module.net.parameters(), net.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs, match", [({"accumulate_grad_batches": 2}, "accumulate in training_step"),
                                           ({"gradient_clip_val": 1.0}, "self.clip_gradients")])
def test_automatic_settings_are_refused_under_manual_optimization(tmp_path, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        _trainer(tmp_path, **kwargs).fit(Accumulating(), DataLoader(regression_data(), batch_size=8))


def test_manual_calls_outside_manual_optimization_say_so(tmp_path):
    class Automatic(Accumulating):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.manual_backward(loss)
            return loss

    module = Automatic()
    module.automatic_optimization = True
    with pytest.raises(RuntimeError, match="automatic_optimization = False"):
        _trainer(tmp_path).fit(module, DataLoader(regression_data(), batch_size=8))


def test_planning_counts_both_optimizers_and_names_what_cannot_run_it(tmp_path):
    """The planner sets a manual module up with its two optimizers (no batch: its training_step steps itself); the
    optimizer bytes it plans under ddp equal what a real run's two Adams hold."""
    from trainkit.estimate import estimate

    module = GAN()
    _trainer(tmp_path, max_steps=2).fit(module, DataLoader(gan_data(), batch_size=8))
    held = sum(t.numel() * t.element_size() for o in module.trainer.optimizers for s in o.state.values()
               for t in s.values())
    rows = {r.name: r for r in estimate(GAN(), None, world_size=2).rows}
    assert rows["ddp"].detail["optimizer"] == held > 0
    assert rows["zero_offload"].note == "n/a: zero_offload does not run manual optimization"


class Overflowing(GAN):
    """At batch 1 the generator's loss is infinite: under fp16 loss scaling its step is skipped (every rank alike)
    and the scale backs off, while the discriminator's step of the same batch runs."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real, z = batch
        before = [p.detach().clone() for p in (*self.generator.parameters(), *self.discriminator.parameters())]
        scale = self.trainer.scaler.scale
        with self.toggled_optimizer(opt_g):
            g_loss = _adversarial(self.discriminator(self(z)), real=True) * (float("inf") if batch_idx == 1 else 1)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
        with self.toggled_optimizer(opt_d):
            d_loss = _adversarial(self.discriminator(real), True)
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
        after = [p.detach() for p in (*self.generator.parameters(), *self.discriminator.parameters())]
        changed = [not torch.equal(b, a) for b, a in zip(before, after, strict=True)]
        self.losses.append(torch.tensor([any(changed[:6]), any(changed[6:]), scale]))


def test_an_fp16_overflow_skips_that_optimizers_step_only(tmp_path):
    module = Overflowing()
    trainer = _trainer(tmp_path, max_steps=6, precision="16-mixed")
    trainer.fit(module, DataLoader(gan_data(), batch_size=8))
    moved = torch.stack(module.losses)
    assert moved[:, 0].tolist() == [1.0, 0.0, 1.0] and moved[:, 1].tolist() == [1.0, 1.0, 1.0]
    assert trainer.scaler.scale == moved[1, 2] / 2  # backed off once, at the skipped step
    assert trainer.global_step == 6  # a skipped step is a step, as under automatic optimization


def test_zero_grad_drops_what_the_window_held(tmp_path):
    from tests.parity.gan import Dropped, dropped_plain

    module = Dropped()
    _trainer(tmp_path, max_epochs=1).fit(module, DataLoader(gan_data(), batch_size=8))
    for name, value in dropped_plain(8, 8).items():
        assert torch.equal(dict(module.named_parameters())[name].detach(), value), name


class DroppingOne(GAN):
    """Both networks get gradients from one backward; then one optimizer's alone are dropped, which a window
    reduced as one cannot do."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        z = batch[1]
        opt_d = self.optimizers()[1]
        self.manual_backward(_adversarial(self.discriminator(self(z)), real=True))
        opt_d.zero_grad()


class Retaining(Accumulating):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)  # through the same graph again
        opt.step()
        opt.zero_grad()


def test_manual_backward_arguments_and_what_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="cannot drop one optimizer's alone"):
        _trainer(tmp_path / "a", max_steps=2).fit(DroppingOne(), DataLoader(gan_data(), batch_size=8))
    _trainer(tmp_path / "b", max_steps=2).fit(Retaining(), DataLoader(regression_data(), batch_size=8))

    class Unknown(Accumulating):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.manual_backward(F.mse_loss(self.net(batch[0]), batch[1]), inputs=list(self.parameters()))

    with pytest.raises(TypeError, match="inputs"):
        _trainer(tmp_path / "c", max_steps=2).fit(Unknown(), DataLoader(regression_data(), batch_size=8))


def test_an_optimizer_that_needs_its_closure_is_refused():
    with pytest.raises(ConfigurationError, match=r"LBFGS\.step needs a closure"):
        parse_optimizers(torch.optim.LBFGS([nn.Parameter(torch.zeros(2))]))


class Growing(GAN):
    """A group added to one of two optimizers mid-run (as BaseFinetuning would)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, 1)
        self.extra.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.extra.requires_grad_(True)
            self.optimizers()[1].optimizer.add_param_group({"params": list(self.extra.parameters())})
        super().training_step(batch, batch_idx)


def test_a_group_added_to_one_of_several_optimizers_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="one optimizer only"):
        _trainer(tmp_path, max_steps=8).fit(Growing(), DataLoader(gan_data(), batch_size=8))


class Balanced(Accumulating):
    """A layer's auxiliary loss (a MoE's balance term), which only automatic optimization adds to the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        from trainkit_strategies.experts.auxiliary import add_auxiliary_loss

        add_auxiliary_loss(self.net[0].weight.square().mean())
        super().training_step(batch, batch_idx)


def test_auxiliary_losses_under_manual_optimization_are_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="auxiliary losses"):
        _trainer(tmp_path, max_steps=2).fit(Balanced(), DataLoader(regression_data(), batch_size=8))


def test_the_gradient_hooks_come_off_when_a_fit_fails_before_training(tmp_path):
    module = GAN()
    with pytest.raises(Exception, match="missing"):
        _trainer(tmp_path, max_steps=2).fit(module, DataLoader(gan_data(), batch_size=8),
                                            ckpt_path=tmp_path / "missing")
    assert not any(p._post_accumulate_grad_hooks for p in module.parameters())
