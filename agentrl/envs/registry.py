"""Env ids: `register`, `make`, `spec`, `list_envs`, with lazy `"module:Class"` entry points,
discovery of installed packages through the `agentrl.envs` entry-point group, and ids that are
themselves a `"module:Class"` path importable from the working directory."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import pkgutil
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from agentrl.envs.base import AgentEnv, EnvLoadError

ENTRY_POINT_GROUP = "agentrl.envs"


class UnknownEnvError(LookupError):
    """No env is registered under this id."""


@dataclass
class EnvSpec:
    """How to build one env: `make(id)` = `load_class()(**kwargs)`.

    `entry_point` is a class or a lazy `"module:Class"` string (imported on first use, so
    listing envs never imports their dependencies). A string may also name another
    EnvSpec (`"pkg.envs:SPEC"`), which is how entry-point discovery defers imports.
    """

    id: str
    entry_point: str | type
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def load_class(self) -> type[AgentEnv]:
        target = self.entry_point
        if isinstance(target, str):
            target = _import_object(target, self.id)
        if isinstance(target, EnvSpec):
            return target.load_class()
        if not (isinstance(target, type) and issubclass(target, AgentEnv)):
            raise EnvLoadError(
                f"env {self.id!r}: entry point {self.entry_point!r} gives {target!r}, "
                "not an AgentEnv subclass (or an EnvSpec)"
            )
        return target

    def make(self, **kwargs: Any) -> AgentEnv:
        return self.load_class()(**{**self.kwargs, **kwargs})

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Raise `EnvLoadError` naming the argument, its value and the ones the env takes when
        `make(**kwargs)` could not bind them, or with the env's own words when its constructor
        refuses a value: before a run starts, not in its first episode. A constructor does no
        I/O (the env contract: one instance per episode), so making one here costs nothing."""
        cls = self.load_class()
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            self._check_names(cls, params, kwargs)
        try:
            self.make(**kwargs)
        except (ValueError, TypeError) as e:
            raise EnvLoadError(
                f"env {self.id!r}: {cls.__name__} refused its arguments (env.kwargs): "
                f"{' '.join(str(e).split())}"
            ) from None

    def _check_names(
        self, cls: type[AgentEnv], params: Mapping[str, inspect.Parameter], kwargs: dict[str, Any]
    ) -> None:
        takes = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
        merged = {**self.kwargs, **kwargs}
        unknown = [n for n in merged if n not in takes]
        if unknown:
            name = unknown[0]
            raise EnvLoadError(
                f"env.kwargs.{name}={merged[name]!r}: {cls.__name__} (env {self.id!r}) takes no "
                f"argument {name!r}; it takes {', '.join(takes) or 'none'} "
                "(--set env.kwargs.NAME=VALUE)"
            )
        missing = [n for n in takes if params[n].default is params[n].empty and n not in merged]
        if missing:
            raise EnvLoadError(
                f"env {self.id!r}: {cls.__name__} needs env.kwargs.{missing[0]} "
                f"(--set env.kwargs.{missing[0]}=VALUE)"
            )


def _import_object(entry_point: str, env_id: str) -> Any:
    module_name, _, attr_path = entry_point.partition(":")
    if not module_name or not attr_path:
        raise EnvLoadError(
            f"env {env_id!r}: entry point {entry_point!r} must look like 'package.module:ClassName'"
        )
    try:
        return pkgutil.resolve_name(entry_point)
    except ImportError as e:
        raise EnvLoadError(
            f"env {env_id!r}: cannot import {module_name!r} (entry point {entry_point!r}): "
            f"{type(e).__name__}: {e}"
        ) from e
    except AttributeError as e:
        raise EnvLoadError(f"env {env_id!r}: entry point {entry_point!r}: {e}") from None
    except Exception as e:  # the module ran and raised (a SyntaxError, its own error): one line
        raise EnvLoadError(
            f"env {env_id!r}: importing {module_name!r} raised {type(e).__name__}: "
            f"{' '.join(str(e).split())}; fix the module"
        ) from None


_specs: dict[str, EnvSpec] = {}
_pending: dict[str, str] = {}
"""Installed entry points not imported yet: id -> "module:SPEC"."""
_discovered = False
_lock = threading.Lock()


def register(
    spec_or_id: EnvSpec | str, entry_point: str | type | None = None, **kwargs: Any
) -> EnvSpec:
    """Register an env: `register(EnvSpec(...))` or `register("my_env", "pkg.mod:MyEnv",
    kwargs={...}, description="...")`. Re-registering an id replaces it (with a warning
    if the entry point changed)."""
    if isinstance(spec_or_id, EnvSpec):
        if entry_point is not None or kwargs:
            raise TypeError("register(EnvSpec(...)) takes no further arguments")
        new = spec_or_id
    else:
        if entry_point is None:
            raise TypeError(
                f"register({spec_or_id!r}) needs an entry_point, e.g. 'my_pkg.my_env:MyEnv'"
            )
        new = EnvSpec(spec_or_id, entry_point, **kwargs)
    with _lock:
        old = _specs.get(new.id)
        if old is not None and old.entry_point != new.entry_point:
            warnings.warn(
                f"env {new.id!r} re-registered: {old.entry_point!r} -> {new.entry_point!r}",
                stacklevel=2,
            )
        _specs[new.id] = new
    return new


def _discover() -> None:
    """Note each installed entry point of the `agentrl.envs` group (nothing is imported).

    Runs on the first lookup in each process, so a fresh Ray worker sees the same ids.
    """
    global _discovered
    if _discovered:
        return
    with _lock:
        if not _discovered:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                _pending.setdefault(ep.name, ep.value)
            _discovered = True


def spec(env_id: str) -> EnvSpec:
    """The EnvSpec of `env_id`; an installed entry point is imported on this first use."""
    _discover()
    found = _specs.get(env_id)
    if found is not None:
        return found
    if env_id.startswith(("http://", "https://")):  # an env served by `agentrl env serve`
        from agentrl.envs.remote import RemoteEnv

        return register(EnvSpec(env_id, RemoteEnv.bound_to(env_id), description="served env"))
    if env_id not in _pending and ":" in env_id:
        return register(_spec_from_path(env_id))
    if env_id not in _pending:
        raise UnknownEnvError(_unknown_message(env_id))
    resolved = _resolve_entry_point(env_id, _pending[env_id])
    with _lock:
        _specs.setdefault(env_id, resolved)
        _pending.pop(env_id, None)
    return _specs[env_id]


def _resolve_entry_point(env_id: str, value: str) -> EnvSpec:
    resolved = _import_object(value, env_id)
    if isinstance(resolved, type) and issubclass(resolved, AgentEnv):
        first_line = (resolved.__doc__ or "").strip().split("\n")[0]
        return EnvSpec(env_id, resolved, description=first_line)
    if not isinstance(resolved, EnvSpec):
        raise EnvLoadError(
            f"env {env_id!r}: entry point {value!r} must name an EnvSpec or an AgentEnv subclass, "
            f"got {type(resolved).__name__}"
        )
    if resolved.id != env_id:
        raise EnvLoadError(
            f"env {env_id!r}: entry point {value!r} gives an EnvSpec with id {resolved.id!r}; "
            "make the entry-point name and EnvSpec.id equal"
        )
    return resolved


def _spec_from_path(env_id: str) -> EnvSpec:
    """`"my_env:CapitalsEnv"` names its class: a module in the working directory trains without
    packaging (`agentrl train --env my_env:CapitalsEnv`)."""
    with cwd_importable():
        return _resolve_entry_point(env_id, env_id)


@contextlib.contextmanager
def cwd_importable() -> Iterator[None]:
    """The working directory on sys.path for the block: a console script's sys.path lacks the
    cwd that `python -m` would give it."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def make(env_id: str, **kwargs: Any) -> AgentEnv:
    """A fresh env instance: the spec's kwargs, overridden by `kwargs`."""
    return spec(env_id).make(**kwargs)


def list_envs() -> list[str]:
    """Every registered id, sorted, including installed entry points not yet imported."""
    _discover()
    return sorted(set(_specs) | set(_pending))


def _unknown_message(env_id: str) -> str:
    if env_id.endswith(".py"):  # `--env my_env.py`: the file's env class was meant
        return _file_message(Path(env_id))
    known = list_envs()
    close = difflib.get_close_matches(env_id, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown env id {env_id!r}.{hint} Known ids: {', '.join(known) or 'none'}. "
        f"Register yours with agentrl.envs.register({env_id!r}, 'my_pkg.my_env:MyEnv') before make(), "
        f'or expose an EnvSpec in your package\'s [project.entry-points."{ENTRY_POINT_GROUP}"] '
        "table so every process (Ray workers too) finds it."
    )


def _file_message(path: Path) -> str:
    """An env id that names a Python file: the `module:Class` id that names its env."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    names = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(
            getattr(base, "id", getattr(base, "attr", "")).endswith("Env") for base in node.bases
        )
    ]
    return (
        f"env id {str(path)!r} names a file; give its module and env class, e.g. "
        f"{path.stem}:{names[0] if names else 'MyEnv'}, from the directory that holds {path.name}"
    )
