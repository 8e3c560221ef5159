"""`agentrl train`'s flags: slime's names as config keys, the run config they build with the
recipe, `--config` and `--set`, a notice where a name means something else here than in slime, and
the defaults `--help` shows."""

from __future__ import annotations

import functools
import itertools
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.cli import PlainHelp

if TYPE_CHECKING:
    from typer._click import Context, Parameter

    from agentrl.config import RunConfig
    from agentrl.config_file import ConfigFile


# slime's flags set the config field of their own name (`--eps-clip`: algo.eps_clip), but for
# these. Each is a typed option of `train_command`, so an unknown flag is an error that names it
# (typer: "No such option: --x").
RENAMED_FLAGS = {
    "model": "model.path",
    "async_": "train.use_async",
    "train_backend": "train.backend",
    "max_tokens_per_gpu": "train.max_tokens_per_micro_batch",
    "eval_prompt_data": "env.eval_data",
    "n_samples_per_eval_prompt": "eval.n_samples",
    "eval_temperature": "eval.temperature",
    "lr_warmup_iters": "train.lr_warmup_steps",
}
COMMAND_FLAGS = (
    "env",
    "config",
    "resume",
    "load",
    "ref_load",
    "override",
    "overwrite",
    "set_",
    "show_config",
)
"""`agentrl train`'s own flags; every other one sets a config field."""
OWN_ENV = "my_env:MyEnv"
"""An env without a recipe, for the defaults `--help` shows."""


def slime_values(flags: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """The config values the slime-named flags set (None = not given), and a notice for each
    flag that means something else here than in slime."""
    from agentrl.config import POLICY_LOSS_ESTIMATORS

    values = {config_key(name): value for name, value in flags.items()}
    notices = []
    if flags.get("async_mode") is not None and flags.get("async_") is None:
        values["train.use_async"] = True  # --async-mode full says --async too
    estimator = flags.get("advantage_estimator")
    if estimator in POLICY_LOSS_ESTIMATORS:
        values["algo.advantage_estimator"] = "grpo"
        values["algo.policy_loss"] = estimator
        notices.append(
            f"--advantage-estimator {estimator} is slime's name for grpo advantages with the "
            f"{estimator} loss: set algo.advantage_estimator=grpo, algo.policy_loss={estimator}"
        )
    if flags.get("rollout_max_response_len") is not None:
        notices.append(
            "--rollout-max-response-len caps each turn here (in slime: the whole response); "
            "--rollout-max-context-len caps the whole episode"
        )
    return values, notices


def given_keys(
    values: dict[str, object], overrides: list[str], file: ConfigFile | None
) -> set[str]:
    """The config keys this command line sets: by flag, by `--set`, by `--config`."""
    keys = {key for key, value in values.items() if value is not None}
    keys |= {item.split("=", 1)[0].strip() for item in overrides}
    return keys | set(file.values if file else ())


def kl_type_notice(cfg: RunConfig, given: set[str]) -> list[str]:
    """slime's KL estimator defaults to k1, ours to low_var_kl: said when only the coef is set."""
    if "algo.kl_loss_coef" not in given or "algo.kl_loss_type" in given:
        return []
    return [
        f"algo.kl_loss_type={cfg.algo.kl_loss_type} (slime's default is k1); add "
        "--kl-loss-type k1 to match a slime run"
    ]


def resume_from_load(
    resume: str | None, load: str | None, ref_load: str | None
) -> tuple[str | None, list[str]]:
    """slime's `--load DIR` as `--resume DIR` when DIR holds a run, else a new run (slime's first
    launch of `--load DIR --save DIR`); `--ref-load` noted, not read. Returns (resume, notices)."""
    from agentrl.config import ConfigError
    from agentrl.run.run_dir import RunDirError, resumed_run_dir

    notices = []
    if ref_load is not None:
        notices.append(
            f"--ref-load {ref_load} is not read: the KL reference is the starting model (--model)"
        )
    if load is None:
        return resume, notices
    if resume is not None:
        raise ConfigError(f"--load {load} and --resume {resume}: pass one of them")
    try:
        resumed_run_dir(load)
    except RunDirError:
        return None, [*notices, f"--load {load}: no agentrl run there yet; starting a new one"]
    return load, notices


def build_config(
    env: str | None,
    flags: dict[str, object],
    overrides: list[str],
    resume: str | None,
    *,
    is_override: bool = False,
    config_file: str | None = None,
):
    """Recipe for the env (or, with `--resume`, the run's saved config), then the `--config` file,
    then slime-named flags, then `--set` overrides (last wins). On resume, a flag that changes the
    saved config is refused unless `is_override` (`--override`); the run trains in the directory
    `--resume` names (or `--save`), never in another its run_config.json names. Returns the
    config, the changed fields and notices to show."""
    from agentrl.config import RunConfig, config_from_flags
    from agentrl.config_file import read_config_file
    from agentrl.run.run_dir import RunDirError, config_diff, resumed_run_dir, saved_config

    saved = saved_config(resume) if resume else None
    file = read_config_file(config_file) if config_file else None
    env = env or (file.values.get("env.id") if file else None)  # the file's env: its recipe
    values, notices = slime_values(flags)
    values["env.id"] = env
    base = RunConfig.from_dict(saved) if saved is not None else env or "calculator"
    cfg = config_from_flags(base, values, overrides, file)
    notices += kl_type_notice(cfg, given_keys(values, overrides, file))
    if resume:
        cfg.checkpoint.resume = resume
        if flags.get("save") is None:
            run_dir = resumed_run_dir(resume)
            named = str((saved or {}).get("checkpoint", {}).get("save") or run_dir)
            if Path(named).resolve() != run_dir.resolve():  # a copy, or a moved run
                notices.append(
                    f"{run_dir / 'run_config.json'} names checkpoint.save={named!r}; this run "
                    f"trains in {str(run_dir)!r}, the --resume directory"
                )
            cfg.checkpoint.save = str(run_dir)
    changed = config_diff(saved, cfg.to_dict()) if saved is not None else []
    if changed and not is_override:
        raise RunDirError(
            f"--resume {resume}: these flags change the saved run config: {'; '.join(changed)}; "
            "add --override to apply them, or drop them to continue as saved"
        )
    return cfg, changed, notices


def config_key(flag: str) -> str:
    """The config field a slime-named flag sets: the one field named so, else `RENAMED_FLAGS`'s."""
    from agentrl.config import RunConfig

    sections = typing.get_type_hints(RunConfig).items()
    keys = [f"{name}.{flag}" for name, section in sections if flag in section.__dataclass_fields__]
    return RENAMED_FLAGS.get(flag) or keys[0]


def default_help(flag: str) -> str:
    """The default of a flag's config field: the same for every env, or the calculator recipe's
    and that of an env without a recipe."""
    section, name = config_key(flag).split(".")
    recipe, plain = (getattr(getattr(cfg, section), name) for cfg in _help_configs())
    if recipe == plain:
        return f"default: {_shown(plain)}"
    return f"default: {_shown(recipe)} for calculator, {_shown(plain)} without a recipe"


@functools.cache
def _help_configs() -> tuple[RunConfig, RunConfig]:
    from agentrl.config import recipe_for_env

    return recipe_for_env("calculator"), recipe_for_env(OWN_ENV)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def eval_data_path(args: list[str]) -> list[str]:
    """slime's `--eval-prompt-data NAME PATH` as `--eval-prompt-data PATH`: `train` takes no
    argument, so a second word after the flag can only be slime's pair. More pairs than one are
    refused in one line: a run evaluates one held-out file."""
    from agentrl.cli import fail

    flag = "--eval-prompt-data"
    if flag not in args[:-1]:
        return args
    at = args.index(flag) + 1
    words = list(itertools.takewhile(lambda arg: not arg.startswith("-"), args[at:]))
    if len(words) > 2:
        fail(
            f"{flag} {' '.join(words)}: a run evaluates one held-out file; give one PATH "
            f"(or slime's NAME PATH), e.g. {flag} {words[-1]}"
        )
    return args[:at] + words[-1:] + args[at + len(words) :]


class TrainCommand(PlainHelp):
    """`agentrl train`, whose help gives each config flag its default (unless its text does)."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, eval_data_path(args))

    def help_record(self, ctx: Context, param: Parameter) -> tuple[str, str] | None:
        record = super().help_record(ctx, param)
        if record is None or param.name in (*COMMAND_FLAGS, "help") or "default:" in record[1]:
            return record
        names, text = record
        return names, f"{text.rstrip('.')} ({default_help(str(param.name))})."
