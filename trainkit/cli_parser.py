"""The command line's parser and its saved configuration, as Lightning's ``lightning.pytorch.cli`` has them.

``Parser`` is jsonargparse's ``ArgumentParser`` with what Lightning's ``LightningArgumentParser`` adds to it
(``add_lightning_class_args``) and errors as one short block; ``SaveConfigCallback`` is Lightning's: it writes the
parsed configuration into the log directory when the first run sets up, so ``--config`` of that file reproduces it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from jsonargparse import ArgumentParser, Namespace, class_from_function

from trainkit.callbacks.base import Callback
from trainkit.data import DataModule
from trainkit.errors import ConfigurationError
from trainkit.module import TrainModule
from trainkit.trainer import Trainer
from trainkit_strategies.registry import MOVED


class Parser(ArgumentParser):
    """jsonargparse's parser, with errors as one short block: the error, which names the fix, and where to find the
    accepted options (not the 40-line usage before them); printed by rank 0 alone when trainkit launched the ranks
    (every rank parses the same command line and would say the same thing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.callback_keys: list[str] = []  # the groups add_lightning_class_args added for a Callback class

    def add_lightning_class_args(self, lightning_class: type | Callable[..., Any], nested_key: str,
                                 subclass_mode: bool = False, required: bool = True) -> list[str]:
        """Lightning's: the ``__init__`` arguments of a Trainer, TrainModule, DataModule or Callback class (or of a
        function that returns one) as the group ``--<nested_key>.<arg>``; with ``subclass_mode``, a class path of
        any subclass. A Callback's instance joins the Trainer's callbacks, as under Lightning's ``LightningCLI``;
        another class's is ``cli.config_init[nested_key]``. Returns the keys added."""
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not (isinstance(lightning_class, type) and issubclass(lightning_class, (Trainer, TrainModule, DataModule,
                                                                                    Callback))):
            raise TypeError(f"add_lightning_class_args takes a Trainer, TrainModule, DataModule or Callback class "
                            f"(or a function returning one); got {lightning_class!r}. Add other classes with "
                            f"parser.add_class_arguments(cls, {nested_key!r}).")
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False,
                                        instantiate=not issubclass(lightning_class, Trainer), sub_configs=True)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        if not (os.environ.get("TRAINKIT_LAUNCHED") and os.environ.get("RANK", "0") != "0"):
            sys.stderr.write(f"{prog.split()[0]}: error: {_moved(_essential(message))}\nRun `{prog} --help` for "
                             "the accepted options.\n")
        self.exit(2)


def _essential(message: str) -> str:
    """What of jsonargparse's message the user needs: for a value no alternative of a union accepts (a strategy's
    option out of range, say), the reason the intended class gave, not the list of every alternative's."""
    message = re.sub(r"\b(?:fit|validate|test|predict|estimate|export)\.([\w.]+)", r"--\1", message)  # as typed
    if "Does not validate against any of the Union subtypes" not in message:
        return message
    key = message.split(":", 1)[0] + ": " if message.startswith("Parser key") else ""
    reasons: list[list[str]] = []  # each alternative's reason: its bullet and the lines indented under it
    depth = 0
    for line in message.splitlines():
        text = line.strip()
        if text.startswith("- "):
            depth = len(line) - len(line.lstrip())
            reasons.append([text[2:]])
        elif reasons and len(line) - len(line.lstrip()) > depth:
            reasons[-1].append(text)
        else:
            depth = 1 << 30
    chosen = [" ".join(r) for r in reasons if not r[0].startswith("Expected a")]
    return key + chosen[0] if chosen else message


def _moved(message: str) -> str:
    """``message`` and, where it refuses an option strategies took in an older trainkit, where that is set now."""
    refused = re.search(r"Option '(\w+)' is not accepted", message)
    return f"{message}\n{MOVED[refused[1]]}" if refused and refused[1] in MOVED else message


class SaveConfigCallback(Callback):
    """Lightning's: when the first run of the Trainer sets up, rank 0 writes ``config`` (every value, the defaults
    and the seed used included) to ``<log_dir>/<config_filename>``; nothing without a logger. A file already there
    (a logger's fixed version, a rerun into the same directory) is an error unless ``overwrite``. Override
    ``save_config`` to store it elsewhere too (it runs on rank 0 alone)."""

    def __init__(self, parser: ArgumentParser, config: Namespace, config_filename: str = "config.yaml",
                 overwrite: bool = False) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self.already_saved = False

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.already_saved or trainer.logger is None:
            return
        path = trainer.logger.log_dir / self.config_filename
        exists = trainer.strategy.comm.broadcast_object(trainer.is_global_zero and path.is_file())  # rank 0's view
        if exists and not self.overwrite:
            raise ConfigurationError(
                f"{path} exists (a previous run's configuration), and {type(self).__name__} does not overwrite it: "
                "delete it, pass save_config_kwargs={\"overwrite\": True} to TrainkitCLI to overwrite it, or "
                "save_config_callback=None to write none.")
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.parser.dump(self.config, skip_unset=False, skip_validation=True))
            self.save_config(trainer, module, stage)
        self.already_saved = True

    def save_config(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        """Store the configuration somewhere else as well (rank 0 only; no collective calls here)."""
