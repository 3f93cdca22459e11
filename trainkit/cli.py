"""The ``trainkit`` command line: ``trainkit fit|validate|test|predict|export`` over jsonargparse.

Every Trainer argument is ``--trainer.<name>``; the model and data are class paths with their init
arguments (``--model mypkg.MyModule --model.lr 1e-3``); ``--config`` reads YAML and ``--print_config``
writes the full configuration, so a run is reproducible from one file. With no ``--model``, the
embedded demo (TinyGPT on a synthetic Markov corpus) runs. ``trainkit export CHECKPOINT OUT`` writes a
checkpoint's model to safetensors. In your own script::

    from trainkit.cli import TrainkitCLI
    TrainkitCLI(MyModule)     # model fixed: its init arguments become --model.<arg> (main(MyModule) does the same)

``TrainkitCLI`` is Lightning's ``LightningCLI`` under trainkit's name: ``run=False``, ``trainer_defaults``,
``seed_everything_default`` (``--seed_everything``), ``save_config_kwargs``, ``add_arguments_to_parser``
(``parser.link_arguments``, ``parser.add_lightning_class_args``, ``parser.set_defaults``) and the hooks work as there.
The parser and ``SaveConfigCallback`` are in ``cli_parser.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, lazy_instance

from trainkit import arguments, launcher, resume
from trainkit.activation import resolve_mode
from trainkit.callbacks.prediction_writer import PredictionWriter
from trainkit.checkpoint import CheckpointError
from trainkit.cli_parser import Parser, SaveConfigCallback
from trainkit.data import DataModule
from trainkit.demo.gpt import DemoGPT
from trainkit.errors import ConfigurationError
from trainkit.estimate import NoBatch, estimate, one_batch
from trainkit.export import export
from trainkit.finite import NonFiniteError
from trainkit.module import TrainModule
from trainkit.seed import seed_everything
from trainkit.signals import PREEMPTED_EXIT_CODE, Preempted
from trainkit.trainer import Trainer
from trainkit_strategies import Environment, Strategy
from trainkit_strategies.communication.comm import PeerError
from trainkit_strategies.registry import available

SUBCOMMANDS = {
    "fit": "Train a model (resume with --ckpt_path last).",
    "validate": "Run the validation loop once.",
    "test": "Run the test loop once.",
    "predict": "Run prediction over the predict dataloader.",
}
TOOLS = {
    "estimate": "Per-rank memory and communication of every strategy for this model, without allocating it.",
    "export": "Write a checkpoint's model to model.safetensors (or shards with an index), streaming piece by piece.",
}
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a program Ctrl-C stopped
DEMO_MODEL = "trainkit.demo.gpt.DemoGPT"
DEMO_DATA = "trainkit.demo.markov.MarkovData"
DEMO_TRAINER = {"max_steps": 2000, "val_check_interval": 500, "check_val_every_n_epoch": None,
                "log_every_n_steps": 25, "seed": 0}


def _subcommand_parser(name: str, model_class: type[TrainModule] | None,
                       datamodule_class: type[DataModule] | None) -> ArgumentParser:
    parser = _class_arguments(Parser(description=SUBCOMMANDS.get(name) or TOOLS[name], exit_on_error=True),
                              model_class, datamodule_class)
    parser.add_argument("--ckpt_path", type=str | None, default=None,
                        help='Checkpoint directory to resume from or load, "last" (the newest) or "best" (the best '
                             "by a ModelCheckpoint's monitor).")
    if name == "predict":
        parser.add_argument("--output", type=str | None, default=None,
                            help="The safetensors file to write the predictions to, in the dataset's order (default: "
                                 "<default_root_dir>/predictions.safetensors; docs/cli.md#predictions).")
    return parser


def _class_arguments(parser: ArgumentParser, model_class: type[TrainModule] | None,
                     datamodule_class: type[DataModule] | None) -> ArgumentParser:
    """``--config``, ``--trainer.*``, and the model and data (fixed classes, or class paths)."""
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="YAML config file (see --print_config).")
    parser.add_class_arguments(Trainer, "trainer", fail_untyped=False, instantiate=False)
    for action in parser._actions:  # the names a user passes, not only the classes jsonargparse knows of
        if action.dest == "trainer.strategy":
            action.help = (f"auto (the default: single on one process; on several, the fastest plan that fits "
                           f"device_memory) or a strategy by name: {', '.join(sorted(available()))}; its options "
                           "follow as --trainer.strategy.<option> (docs/strategies.md).")
    if model_class is None:
        parser.add_subclass_arguments(TrainModule, "model", required=False, default=lazy_instance(DemoGPT),
                                      help="TrainModule class path (default: the embedded TinyGPT demo).")
    else:
        parser.add_class_arguments(model_class, "model")
    if datamodule_class is None:
        parser.add_subclass_arguments(DataModule, "data", required=False,
                                      help="DataModule class path (default: the model's own dataloaders).")
    else:
        parser.add_class_arguments(datamodule_class, "data")
    return parser


def build_parser(model_class: type[TrainModule] | None = None,
                 datamodule_class: type[DataModule] | None = None, prog: str = "trainkit",
                 configure: Callable[[ArgumentParser], None] = lambda parser: None) -> ArgumentParser:
    """The command line; ``prog``: what it is called (a script built on ``main`` names itself); ``configure``: what a
    ``TrainkitCLI`` adds to each subcommand's parser that builds a model (its defaults, arguments and links)."""
    parser = Parser(prog=prog, description="Train PyTorch models with trainkit.")
    subcommands = parser.add_subcommands(required=True, dest="subcommand")
    for name in SUBCOMMANDS:
        sub_parser = _subcommand_parser(name, model_class, datamodule_class)
        configure(sub_parser)
        subcommands.add_subcommand(name, sub_parser, help=SUBCOMMANDS[name])
    estimate_parser = _subcommand_parser("estimate", model_class, datamodule_class)
    configure(estimate_parser)
    estimate_parser.add_argument("--devices_per_node", type=int | None, default=None,
                                 help="Ranks per machine (default: --trainer.devices).")
    estimate_parser.add_argument("--nodes", type=int | None, default=None,
                                 help="Machines (default: --trainer.num_nodes).")
    estimate_parser.add_argument("--device_memory", type=str | None, default=None,
                                 help='Memory of one device, e.g. "80GB" (default: the GPU\'s, if there is one).')
    estimate_parser.add_argument("--host_memory", type=str | None, default=None,
                                 help='Host memory of one rank, e.g. "64GB": a plan whose setup or offloaded state '
                                      "overflows it does not fit.")
    estimate_parser.add_argument("--device_type", type=Literal["cpu", "cuda"] | None, default=None,
                                 help="Plan a run on this kind of device (default: --trainer.accelerator's); "
                                      "cuda plans a GPU run from any machine (offload's page-locked copies, "
                                      "device scratch).")
    subcommands.add_subcommand("estimate", estimate_parser, help=TOOLS["estimate"])
    subcommands.add_subcommand("export", _export_parser(), help=TOOLS["export"])
    return parser


def _export_parser() -> ArgumentParser:
    parser = Parser(description=TOOLS["export"], exit_on_error=True)
    parser.add_argument("checkpoint", type=str, help="A checkpoint directory, or a directory with a `latest` pointer.")
    parser.add_argument("out", type=str, help="Directory to write the safetensors file(s) into.")
    parser.add_argument("--max_shard_size", type=str | None, default=None,
                        help='Shards of at most this size ("5GB", "500MB") plus model.safetensors.index.json.')
    parser.add_argument("--dtype", type=str | None, default=None,
                        help='Convert floating-point tensors: "fp32", "bf16" or "fp16" (default: as stored).')
    parser.add_argument("--submodule", type=str | None, default=None,
                        help='Export only this submodule ("gpt" for self.gpt = GPT2LMHeadModel(...)), named as in it, '
                             "with its config.json when it has one: a directory from_pretrained loads.")
    return parser


def _estimate(parser: ArgumentParser, cfg: Namespace, sub_parser: ArgumentParser) -> None:
    """Build the model on the meta device, take one training batch, and print the plan of every strategy."""
    sub_cfg = cfg.estimate
    model_cfg = sub_cfg.get("model")
    if isinstance(model_cfg, Namespace) and model_cfg.get("class_path") == DEMO_MODEL and sub_cfg.get("data") is None:
        sub_cfg.data = Namespace(class_path=DEMO_DATA, init_args=Namespace())
    try:
        with torch.device("meta"):
            init = parser.instantiate(cfg).estimate
    except (ValueError, TypeError) as err:  # a DataModule's or model's own check of its options
        sub_parser.error(str(err))
    model, data, args = init.model, init.data, sub_cfg.trainer
    try:
        try:
            batch = one_batch(model, data)
        except NoBatch:  # the model-state columns need none; the activations and the step's bytes are unknown
            batch = None
        accelerator = arguments.resolve_accelerator(args.accelerator)
        devices = arguments.resolve_devices(args.devices, accelerator)
        world = (sub_cfg.devices_per_node or devices) * (sub_cfg.nodes or args.num_nodes)
        device_type = sub_cfg.device_type or Environment.accelerator_type(accelerator)
        memory = sub_cfg.device_memory
        if memory is None and device_type == "cuda" and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory
        plan = estimate(model, batch, world_size=world, precision=args.precision, device_memory=memory,
                        activation_checkpointing=args.activation_checkpointing, device_type=device_type,
                        devices_per_node=sub_cfg.devices_per_node or devices,
                        activation_checkpointing_every=args.activation_checkpointing_every,
                        host_memory=sub_cfg.host_memory, strategy=_named_strategy(init.trainer.get("strategy")))
    except (ValueError, TypeError, RuntimeError) as err:
        sub_parser.error(str(err))
    print(plan.table(), flush=True)
    checkpointing = args.activation_checkpointing
    try:  # the run's own strategy (--trainer.strategy) is refused when it cannot fit, its setup included
        plan.refuse_unfit(resolve_mode(checkpointing) if checkpointing else None)
    except ConfigurationError as err:
        sub_parser.error(str(err))


def _named_strategy(strategy: Any) -> Strategy | None:
    """The strategy ``--trainer.strategy`` built (None for "auto": the plan is of every candidate)."""
    return strategy if isinstance(strategy, Strategy) else None


def _export(cfg: Namespace, parser: ArgumentParser) -> None:
    try:
        files = export(cfg.checkpoint, cfg.out, cfg.max_shard_size, cfg.dtype, cfg.submodule)
    except (CheckpointError, ValueError, OSError) as err:
        parser.error(str(err))
    for path in files:
        print(path)


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Put the subcommand first wherever it was typed, and expand registered strategy names.

    ``--trainer.strategy zero2 --trainer.strategy.bucket_mb 25`` becomes the class-path form
    jsonargparse needs to accept the strategy's own options.
    """
    argv = list(argv)
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in TOOLS:
        for i, token in enumerate(argv):
            if token in SUBCOMMANDS and not (i > 0 and argv[i - 1].startswith("--") and "=" not in argv[i - 1]
                                             and argv[i - 1] not in ("--print_config",)):
                argv.insert(0, argv.pop(i))
                break
    names = available()
    for i, token in enumerate(argv):
        if token.startswith("--trainer.strategy="):
            value = token.split("=", 1)[1]
            if value in names:
                argv[i] = "--trainer.strategy=" + names[value].replace(":", ".")
        elif token == "--trainer.strategy" and i + 1 < len(argv) and argv[i + 1] in names:
            argv[i + 1] = names[argv[i + 1]].replace(":", ".")
    return argv


def _demo_data_named(argv: list[str]) -> list[str]:
    """The demo model's data options given without its class (``--data.train_sequences 4096``): the demo data's
    (``--data trainkit.demo.markov.MarkovData`` put before them), as the demo run uses it by default."""
    named = lambda flag: any(t == flag or t.startswith(f"{flag}=") for t in argv)
    model = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--model"), None)
    first = next((i for i, t in enumerate(argv) if t.startswith("--data.")), None)
    if first is None or named("--data") or named("--config") or (model not in (None, DEMO_MODEL)) or \
            any(t.startswith("--model=") for t in argv):
        return argv
    return [*argv[:first], "--data", DEMO_DATA, *argv[first:]]


def _instantiate(parser: ArgumentParser, cfg: Namespace, subcommand: str | None,
                 callbacks: Sequence[Any] = ()) -> tuple[Trainer, TrainModule, Any, Namespace]:
    """The Trainer, model, data and every instance (``config_init``) of ``cfg`` (of its ``subcommand``). The
    Trainer's callbacks are the configured ones, then the instances of the parser's ``add_lightning_class_args``
    Callback groups, then ``callbacks``: in Lightning's order."""
    sub_cfg = cfg[subcommand] if subcommand else cfg
    if sub_cfg.get("seed_everything") not in (None, False):  # Lightning's: before the classes, True for the default
        sub_cfg.seed_everything = seed_everything(None if sub_cfg.seed_everything is True else
                                                  sub_cfg.seed_everything)  # config.yaml records the seed used
    model_cfg = sub_cfg.get("model")  # a fixed main(MyModule) has no class_path (nor a group without arguments)
    is_demo = isinstance(model_cfg, Namespace) and model_cfg.get("class_path") == DEMO_MODEL
    if is_demo and sub_cfg.get("data") is None:
        sub_cfg.data = Namespace(class_path=DEMO_DATA, init_args=Namespace())
    seed = sub_cfg.trainer.seed if sub_cfg.trainer.seed is not None else (DEMO_TRAINER["seed"] if is_demo else None)
    if seed is not None:
        seed_everything(seed)  # before the model is built (after --seed_everything): the weights follow this seed
    config_init = parser.instantiate(cfg)
    init = config_init[subcommand] if subcommand else config_init
    own = parser._subcommands_action._name_parser_map[subcommand] if subcommand else parser
    callbacks = [*(init[key] for key in getattr(own, "callback_keys", ())), *callbacks]
    model, data = init.model, init.data
    trainer_args = dict(init.trainer)
    if is_demo:
        defaults = Trainer.__init__.__kwdefaults__
        for key, value in DEMO_TRAINER.items():
            if trainer_args.get(key) == defaults[key]:
                trainer_args[key] = sub_cfg.trainer[key] = value  # also into the saved config.yaml
        schedule_default = inspect.signature(DemoGPT).parameters["max_steps"].default
        if model.hparams.max_steps == schedule_default and trainer_args["max_steps"] > 0:
            model.hparams.max_steps = trainer_args["max_steps"]  # the LR schedule spans the run unless set
            if isinstance(model_cfg.get("init_args"), Namespace):  # and config.yaml records the schedule it used
                model_cfg.init_args.max_steps = trainer_args["max_steps"]
    if callbacks:
        trainer_args["callbacks"] = [*(trainer_args.get("callbacks") or []), *callbacks]
    trainer = Trainer(**trainer_args)
    return trainer, model, data, config_init


class TrainkitCLI:
    """Lightning's ``LightningCLI``, under trainkit's name: the ``trainkit`` command line over ``model_class`` and
    ``datamodule_class`` (fixed: their ``__init__`` arguments become ``--model.<arg>`` / ``--data.<arg>``; None: a
    class path, the demo by default), customised as a Lightning user customises it.

    Args:
        model_class, datamodule_class: the classes, or None for ``--model CLASS`` / ``--data CLASS``.
        save_config_callback: the class that writes ``config.yaml`` into the log directory (``SaveConfigCallback``
            or a subclass); None writes none.
        save_config_kwargs: its keyword arguments: ``{"overwrite": True}`` replaces a file already there (an error
            otherwise), ``{"config_filename": "run.yaml"}`` names the file.
        trainer_defaults: Trainer arguments' defaults (``{"max_epochs": 5}``), which flags and ``--config`` still
            override; its ``callbacks`` are added to every run's, as Lightning's "persistent callbacks" are.
        seed_everything_default: the default of ``--seed_everything``, with which ``seed_everything`` seeds before
            the model and data are built: an int; True (Lightning's default) for the seed a launching rank 0 set,
            else 0; False seeds nothing (``--trainer.seed``, when set, seeds after it either way).
        args: the arguments (default: the command line's), a list as ``sys.argv[1:]`` holds them.
        run: True parses ``fit|validate|test|predict|estimate|export ...`` and runs it; False takes no subcommand
            (``--trainer.*``, ``--model.*``, ``--data.*``, ``--config``), builds ``self.trainer``, ``self.model`` and
            ``self.datamodule``, and runs nothing: ``cli.trainer.fit(cli.model, datamodule=cli.datamodule)`` next.

    Override ``add_arguments_to_parser(parser)`` to add arguments or link them (``parser.link_arguments(
    "data.batch_size", "model.batch_size")``: set once, given to both; ``parser.add_lightning_class_args(MyCallback,
    "my")``: ``--my.<arg>`` flags and the callback in the Trainer's; ``parser.set_defaults``),
    ``before_instantiate_classes()``, ``after_instantiate_classes()`` (``self.config_init`` holds every instance), and
    ``before_<subcommand>()`` / ``after_<subcommand>()`` (``before_fit``, ...) to run code around a subcommand.
    """

    def __init__(self, model_class: type[TrainModule] | None = None, datamodule_class: type[DataModule] | None = None,
                 save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
                 save_config_kwargs: dict[str, Any] | None = None, trainer_defaults: dict[str, Any] | None = None,
                 seed_everything_default: bool | int = True, args: Sequence[str] | None = None,
                 run: bool = True) -> None:
        self.model_class, self.datamodule_class = model_class, datamodule_class
        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.subcommand: str | None = None
        self.trainer: Trainer | None = None
        self.model: TrainModule | None = None
        self.datamodule: Any = None
        script = model_class is not None and args is None and sys.argv and sys.argv[0].endswith(".py")
        prog = Path(sys.argv[0]).name if script else "trainkit"
        given = list(sys.argv[1:] if args is None else args)
        if run:
            self.parser = build_parser(model_class, datamodule_class, prog, self._configure)
            self._run_command(given)
            return
        self.parser = _class_arguments(Parser(prog=prog, description=SUBCOMMANDS["fit"], exit_on_error=True),
                                       model_class, datamodule_class)
        self._configure(self.parser)
        argv = normalize_argv(given)
        self.config = self.parser.parse_args(_demo_data_named(argv) if model_class is datamodule_class is None else
                                             argv)
        self.before_instantiate_classes()
        try:
            self.trainer, self.model, self.datamodule, self.config_init = _instantiate(
                self.parser, self.config, None, self._persistent_callbacks(self.parser, self.config))
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            self.parser.error(str(err))
        self.after_instantiate_classes()

    # -- what a subclass overrides, as in Lightning -------------------------------------------------
    def add_arguments_to_parser(self, parser: ArgumentParser) -> None:
        """Add arguments to ``parser`` (one subcommand's), or link them: ``parser.link_arguments("data.batch_size",
        "model.batch_size")`` gives the model the data's value (and ``--model.batch_size`` is no longer a flag)."""

    def before_instantiate_classes(self) -> None:
        """Runs after parsing (``self.config``), before the model, data and Trainer are built."""

    def after_instantiate_classes(self) -> None:
        """Runs once ``self.trainer``, ``self.model``, ``self.datamodule`` and ``self.config_init`` are built."""

    # -- the command line ----------------------------------------------------------------------------
    def _configure(self, parser: ArgumentParser) -> None:
        parser.add_argument("--seed_everything", type=bool | int, default=self.seed_everything_default,
                            help="Seed python, numpy and torch with this int before the model and data are built; "
                                 "true: the seed a launching rank 0 set, else 0; false: no seeding.")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        if defaults:
            parser.set_defaults(defaults)
        self.add_arguments_to_parser(parser)

    def _persistent_callbacks(self, parser: ArgumentParser, config: Namespace) -> list[Any]:
        """``trainer_defaults``' callbacks and the one that saves ``config`` (what ``parser`` parsed)."""
        value = self.trainer_defaults.get("callbacks") or []
        callbacks = list(value) if isinstance(value, Sequence) else [value]
        if self.save_config_callback:
            callbacks.append(self.save_config_callback(parser, config, **self.save_config_kwargs))
        return callbacks

    def _run_command(self, given: list[str]) -> None:
        parser = self.parser
        if given and given[0].startswith("-") and not {"-h", "--help", *SUBCOMMANDS, *TOOLS} & set(given):
            parser.error(f"name what to do first: one of {', '.join([*SUBCOMMANDS, *TOOLS])} (`{parser.prog} fit "
                         f"{' '.join(given)}`, say).")
        argv = normalize_argv(given)
        if self.model_class is None and self.datamodule_class is None:
            argv = _demo_data_named(argv)
        self.config = cfg = parser.parse_args(argv)
        self.subcommand = subcommand = cfg.subcommand
        sub_parser = parser._subcommands_action._name_parser_map[subcommand]
        if subcommand == "export":
            _export(cfg[subcommand], sub_parser)
            return
        if subcommand == "estimate":
            _estimate(parser, cfg, sub_parser)
            return
        self.before_instantiate_classes()
        try:
            self.trainer, self.model, self.datamodule, self.config_init = _instantiate(
                parser, cfg, subcommand, self._persistent_callbacks(sub_parser, cfg[subcommand]))
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            sub_parser.error(str(err))
        self.after_instantiate_classes()
        trainer = self.trainer
        if subcommand == "predict":
            output = cfg[subcommand].output
            trainer.callbacks.append(PredictionWriter(output if output is not None else
                                                      trainer.default_root_dir / "predictions.safetensors"))
        before, after = (getattr(self, f"{when}_{subcommand}", None) for when in ("before", "after"))
        with _reported(trainer, parser.prog, subcommand):
            if callable(before):
                before()
            getattr(trainer, subcommand)(self.model, datamodule=self.datamodule, ckpt_path=cfg[subcommand].ckpt_path)
            if callable(after):
                after()
        code = launcher.wait_children()
        if code:
            print(f"trainkit: error: a launched rank exited with code {code}.", file=sys.stderr)
            sys.exit(code)


@contextlib.contextmanager
def _reported(trainer: Trainer, prog: str, subcommand: str) -> Iterator[None]:
    """A subcommand's errors as the command line reports them: one block, the exit status (docs/cli.md)."""
    try:
        yield
    except ConfigurationError as err:  # raised alike on every rank: said once
        if trainer.is_global_zero:
            print(f"{prog}: error: {err}\nRun `{prog} {subcommand} --help` for the accepted options.",
                  file=sys.stderr, flush=True)
        launcher.wait_children()
        sys.exit(2)
    except (PeerError, CheckpointError) as err:
        print(f"trainkit: error (rank {trainer.global_rank}): {err}", file=sys.stderr)
        sys.exit(1)
    except NonFiniteError as err:  # raised alike on every rank: said once
        if trainer.is_global_zero:
            print(f"trainkit: error: {err}", file=sys.stderr, flush=True)
        launcher.wait_children()
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C, here or on a peer (failures.Interrupted): said once, without a traceback
        if trainer.is_global_zero:
            said = "trainkit: interrupted"
            if subcommand == "fit":
                said += f" after step {trainer.global_step}. {resume.resume_hint(trainer.checkpoint_dir, 'Ctrl-C')}"
            print(said, file=sys.stderr, flush=True)
        launcher.wait_children()
        sys.exit(INTERRUPTED_EXIT_CODE)
    except Preempted as stop:
        print(f"trainkit: rank {trainer.global_rank} {stop}", file=sys.stderr, flush=True)
        launcher.wait_children()
        sys.exit(PREEMPTED_EXIT_CODE)


def main(model_class: type[TrainModule] | None = None, datamodule_class: type[DataModule] | None = None,
         args: Sequence[str] | None = None) -> None:
    """Parse ``args`` (default: the command line) and run the chosen subcommand: ``TrainkitCLI`` with its defaults."""
    TrainkitCLI(model_class, datamodule_class, args=args)


def command() -> None:
    """The ``trainkit`` command (and ``python -m trainkit.cli``): ``main()`` on the command line, then a quick exit
    (``launcher.leave``). A script built on ``main`` returns from it as usual, so its own code may go on."""
    main()
    launcher.leave()


if __name__ == "__main__":
    command()
