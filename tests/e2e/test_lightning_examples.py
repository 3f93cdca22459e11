"""Three of PyTorch Lightning's own examples (the autoencoder, the GAN with two optimizers and manual optimization,
transfer learning with a ``BaseFinetuning`` callback), kept in examples/lightning/ as trainkit files that differ from
the Lightning files only by docs/lightning.md's rename table, log what PyTorch Lightning logs for the same files.

Each example runs as a script under trainkit and, renamed back, under pytorch-lightning (the optional reference of
the ``test`` extra), on the CPU with one thread a process. In one process the values logged per step are bitwise
Lightning's (the same operations in the same order), and the epoch means within 1e-6 (trainkit sums them in fp64,
Lightning in fp32). Under trainkit's ddp at 2 processes, each reading all the data, the average of two equal
gradients is exact and the run must log the same values. (Lightning's own DDP logs them too for the autoencoder and
the fine-tuning; for the GAN it does not, as its DDP strategy seeds the global random state again after the model is
built, so the generator's noise differs.) The autoencoder's printed predictions of its best checkpoint are
Lightning's as printed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .lightning_examples import (
    AGGREGATES,
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


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    """Each example's Lightning file run once in one process under PyTorch Lightning: (logged values, stdout)."""
    done: dict[str, tuple[dict[str, list[float]], str]] = {}

    def get(name: str) -> tuple[dict[str, list[float]], str]:
        if name not in done:
            root = tmp_path_factory.mktemp(f"{name}_lightning")
            script = root / f"{name}.py"
            script.write_text(to_lightning((EXAMPLES / f"{name}.py").read_text()))
            out = run(command(name, script, 1), root / "run")
            done[name] = (logged(root / "run"), out)
        return done[name]

    return get


@pytest.mark.slow
@needs_lightning
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_each_example_logs_what_pytorch_lightning_logs(name, devices, tmp_path, lightning_run):
    want, want_out = lightning_run(name)
    got_out = run(command(name, EXAMPLES / f"{name}.py", devices), tmp_path)
    got = logged(tmp_path)
    for tag in TAGS[name]:
        assert want.get(tag), f"Lightning logged no {tag}: {sorted(want)}"
        assert tag in got, f"{tag} was not logged: {sorted(got)}"
        tolerance = 1e-6 if tag in AGGREGATES else 0.0
        torch.testing.assert_close(torch.tensor(got[tag]), torch.tensor(want[tag]), rtol=0, atol=tolerance,
                                   msg=lambda m, t=tag: f"{name} at {devices} process(es), {t}: {m}")
    if name == "autoencoder":
        assert printed_tensor(got_out) == printed_tensor(want_out)
