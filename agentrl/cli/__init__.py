"""The `agentrl` command line: one module per command group, assembled here."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand, TyperOption

if TYPE_CHECKING:  # the copy of click that typer builds its commands on
    from typer._click import Context, HelpFormatter, Parameter

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for multi-turn, tool-using LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

CLI_ENTRY_POINT_GROUP = "agentrl.cli"
"""Installed packages add command groups here (the bundled search_r1 adds `retriever`): each
entry points at a `register(app)` function."""


class OutputConsole(Console):
    """The console a command writes its output to. A reader that stops early (`agentrl show
    FILE | head`) ends the command quietly with status 0, as it does a Unix tool (rich's own
    console exits 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # nothing more is written, nor flushed at exit
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0)


def fail(message: str, *, code: int = 2) -> NoReturn:
    """The one way a command stops on a user's error: `error: <message>`, one line on stderr, no
    traceback, exit status 2 (bad input) unless `code` says otherwise."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Run a command's body; a user's error ends it with `fail`: what a user fixes from the
    message alone (a flag or config value, a data file, an env id, the model path, a missing
    extra), and `extra`."""
    from agentrl.config import ConfigError
    from agentrl.data import DataError
    from agentrl.deploy.processes import SGLangNotInstalled
    from agentrl.envs.registry import EnvLoadError, UnknownEnvError
    from agentrl.model_store import ModelPathError

    fixable = (ConfigError, DataError, EnvLoadError, UnknownEnvError, ModelPathError)
    try:
        yield
    except (*fixable, SGLangNotInstalled, *extra) as e:
        fail(str(e))


class UserCommand(TyperCommand):
    """A command whose usage errors (an unknown flag, a value of the wrong type, a missing
    argument) are one line like every other user error, not typer's boxed usage block."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        from typer._click.exceptions import BadParameter, NoArgsIsHelpError, UsageError

        given = list(args)  # click's parser consumes `args`
        try:
            return super().parse_args(ctx, args)
        except NoArgsIsHelpError:
            raise  # the help itself
        except UsageError as e:
            message = " ".join(e.format_message().split()).rstrip(".")
            if isinstance(e, BadParameter) and e.param is not None:  # the value it refused
                value = _value_given(given, e.param.opts)
                message += "" if value is None else f" (got {value!r})"
            fail(f"{message}; see {ctx.command_path} --help")


def _value_given(args: list[str], names: list[str]) -> str | None:
    """The value given to a flag named one of `names` (`--lr abc` or `--lr=abc`), if any."""
    for i, arg in enumerate(args):
        name, is_joined, joined = arg.partition("=")
        if name in names:
            return joined if is_joined else (args[i + 1] if i + 1 < len(args) else None)
    return None


class PlainHelp(UserCommand):
    """A command whose `--help` is click's plain layout, one section per `rich_help_panel`:
    rich's option table cuts long flag names at 80 columns (`--n-samples-per-pro…`), click's
    layout wraps the help text and never a name."""

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)  # click's, not typer's rich one

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = self.help_record(ctx, param)
            if record is not None:
                is_typer = isinstance(param, TyperOption | TyperArgument)  # not click's --help
                panel = (param.rich_help_panel if is_typer else None) or "Options"
                sections.setdefault(panel, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)

    def help_record(self, ctx: Context, param: Parameter) -> tuple[str, str] | None:
        """One option's (names, help) line; a command adds to it here (e.g. its defaults)."""
        return param.get_help_record(ctx)


def quiet_libraries() -> None:
    """transformers' weight-loading bars and INFO lines would break into the run's progress
    display and logs; its warnings and errors still show."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()


# Each module defines `register(app)`; heavy imports stay inside the commands.
for _name in ("env", "rollout", "show", "train", "eval", "export", "serve", "sandbox"):
    importlib.import_module(f"agentrl.cli.{_name}").register(app)
for _entry in entry_points(group=CLI_ENTRY_POINT_GROUP):
    try:
        _entry.load()(app)
    except ImportError as e:  # a broken package must not take the whole command line down
        warnings.warn(
            f"agentrl: skipped command group {_entry.name!r} ({_entry.value}): {e}; reinstall "
            "the package that provides it",
            stacklevel=1,
        )


def main() -> None:
    app()
