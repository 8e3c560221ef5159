"""The `agentrl` command line: one module per command group, assembled here."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for multi-turn, tool-using LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

# Each module defines `register(app)`; heavy imports stay inside the commands.
_COMMAND_MODULES = ("env", "rollout", "show", "train", "eval", "serve", "retriever", "sandbox")

for _name in _COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"agentrl.cli.{_name}")
    except ModuleNotFoundError as e:  # a command group not built yet
        if e.name != f"agentrl.cli.{_name}":
            raise
        continue
    _module.register(app)


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


def main() -> None:
    app()
