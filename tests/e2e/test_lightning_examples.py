"""Three of PyTorch Lightning's own examples (the autoencoder, the GAN with two optimizers and manual optimization,
transfer learning with a ``BaseFinetuning`` callback), kept in examples/lightning/ as trainkit files that differ from
the Lightning files only by docs/lightning.md's rename table, log what PyTorch Lightning logs for the same files.

Each example runs as a script under trainkit and, renamed back, under pytorch-lightning (the optional reference of
the ``test`` extra): one process on the CPU, then 2 processes under ddp, one thread each. In one process the logged
values are bitwise Lightning's (the same operations in the same order); under ddp the gradients are averaged by
different all-reduce implementations, so they agree within 1e-6. Where the autoencoder prints its predictions of the
best checkpoint, it prints Lightning's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .lightning_examples import (
    EXAMPLES,
    NAMES,
    TAGS,
    command,
    logged,
    printed_tensor,
    rename_table,
    run,
    to_lightning,
    to_trainkit,
)

LIGHTNING = importlib.util.find_spec("pytorch_lightning") is not None
needs_lightning = pytest.mark.skipif(not LIGHTNING, reason="pytorch-lightning is not installed (the test extra "
                                     "installs it: pip install -e '.[test]')")


def test_the_rename_table_turns_each_lightning_file_into_the_example():
    """The page's table read back is the renaming the docs show, and it is all that separates the two files: the
    table turns the Lightning file into the example character for character, and the Lightning file names nothing
    of trainkit (so it runs where only Lightning is installed)."""
    table = dict(rename_table())
    assert table["LightningModule"] == "TrainModule" and table["pytorch_lightning"] == "trainkit"
    for name in NAMES:
        example = (EXAMPLES / f"{name}.py").read_text()
        lightning = to_lightning(example)
        assert "trainkit" not in lightning, name
        assert "pytorch_lightning" in lightning and lightning != example, name
        assert to_trainkit(lightning) == example, name


@pytest.mark.slow
@needs_lightning
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_each_example_logs_what_pytorch_lightning_logs(name, devices, tmp_path):
    original = tmp_path / f"{name}_lightning.py"
    original.write_text(to_lightning((EXAMPLES / f"{name}.py").read_text()))
    want_out = run(command(name, original, devices, lightning=True), tmp_path / "lightning")
    got_out = run(command(name, EXAMPLES / f"{name}.py", devices, lightning=False), tmp_path / "trainkit")
    want, got = logged(tmp_path / "lightning"), logged(tmp_path / "trainkit")
    for tag in TAGS[name]:
        assert want.get(tag), f"Lightning logged no {tag}: {sorted(want)}"
        assert tag in got, f"{tag} was not logged: {sorted(got)}"
        tolerance = 0.0 if devices == 1 else 1e-6
        torch.testing.assert_close(torch.tensor(got[tag]), torch.tensor(want[tag]), rtol=0, atol=tolerance,
                                   msg=lambda m, t=tag: f"{name} at {devices} process(es), {t}: {m}")
    if name == "autoencoder" and devices == 1:
        assert printed_tensor(got_out) == printed_tensor(want_out)
