"""Env ids: register/make/spec, lazy entry points, discovery in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl.envs.registry as registry
from agentrl.envs import (
    AgentEnv,
    EnvLoadError,
    EnvSpec,
    UnknownEnvError,
    list_envs,
    make,
    register,
    spec,
)
from agentrl.envs.builtin.calculator import CalculatorEnv

REPO_ROOT = Path(__file__).resolve().parents[2]


class KwargsEnv(AgentEnv):
    def __init__(self, size: int = 1, color: str = "red") -> None:
        super().__init__()
        self.size, self.color = size, color


@pytest.fixture(autouse=True)
def restore_registry():
    saved = dict(registry._specs)
    yield
    registry._specs.clear()
    registry._specs.update(saved)


def test_calculator_is_built_in() -> None:
    assert "calculator" in list_envs()
    env = make("calculator")
    assert isinstance(env, CalculatorEnv)
    assert make("calculator") is not env  # a fresh instance each time
    assert spec("calculator").entry_point == "agentrl.envs.builtin.calculator:CalculatorEnv"


def test_make_merges_spec_kwargs_with_call_kwargs() -> None:
    register("test-kwargs", KwargsEnv, kwargs={"size": 3, "color": "blue"}, description="d")
    env = make("test-kwargs", color="green")
    assert (env.size, env.color) == (3, "green")
    assert spec("test-kwargs").description == "d"


def test_string_entry_points_load_lazily() -> None:
    register(EnvSpec("test-lazy", "no_such_module_xyz.envs:Env"))
    assert "test-lazy" in list_envs()  # listing imports nothing
    with pytest.raises(EnvLoadError, match=r"test-lazy.*no_such_module_xyz"):
        make("test-lazy")


@pytest.mark.parametrize(
    ("entry_point", "match"),
    [
        ("agentrl.envs.builtin.calculator", "must look like 'package.module:ClassName'"),
        ("agentrl.envs.builtin.calculator:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
        ("agentrl.envs.builtin.calculator:evaluate", "not an AgentEnv subclass"),
    ],
)
def test_bad_entry_points_name_the_problem(entry_point: str, match: str) -> None:
    register("test-bad", entry_point)
    with pytest.raises(EnvLoadError, match=match):
        make("test-bad")


def test_env_kwargs_are_checked_against_the_env_before_a_run() -> None:
    class Needs(AgentEnv):
        def __init__(self, corpus: str, *, topk: int = 3) -> None:
            super().__init__()

    class TakesAny(AgentEnv):
        def __init__(self, **options) -> None:
            super().__init__()

    register("test-needs", Needs)
    register("test-any", TakesAny)
    needs = spec("test-needs")
    needs.check_kwargs({"corpus": "c.jsonl", "topk": 5})  # binds: no error
    with pytest.raises(EnvLoadError) as e:
        needs.check_kwargs({"corpus": "c.jsonl", "top_k": 5})
    assert str(e.value).startswith("env.kwargs.top_k=5: Needs (env 'test-needs') takes no argument")
    assert "it takes corpus, topk" in str(e.value)
    with pytest.raises(
        EnvLoadError, match=r"needs env\.kwargs\.corpus \(--set env\.kwargs\.corpus=VALUE\)"
    ):
        needs.check_kwargs({})
    spec("test-any").check_kwargs({"whatever": 1})  # **kwargs takes anything


@pytest.mark.parametrize("given", ["my_env.py", "{tmp}/my_env.py"])
def test_an_env_id_that_names_a_file_says_to_give_module_and_class(
    tmp_path, monkeypatch, given
) -> None:
    """`--env my_env.py` listed the registered ids and how to register one: the user meant the
    file's env, which `my_env:CapitalsEnv` names."""
    (tmp_path / "my_env.py").write_text(
        "from agentrl.envs import AgentEnv\n\nclass Helper:\n    pass\n\n"
        "class CapitalsEnv(AgentEnv):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownEnvError) as e:
        make(given.format(tmp=tmp_path))
    assert str(e.value).startswith(
        f"env id {given.format(tmp=tmp_path)!r} names a file; give its module and env class, "
        "e.g. my_env:CapitalsEnv, from the directory that holds my_env.py"
    )


def test_unknown_id_lists_known_ids_and_how_to_register() -> None:
    with pytest.raises(UnknownEnvError) as e:
        make("calculater")
    text = str(e.value)
    assert "unknown env id 'calculater'" in text
    assert "Did you mean 'calculator'?" in text
    assert "Known ids: " in text and "calculator" in text
    assert "agentrl.envs.register('calculater'" in text and "agentrl.envs" in text


def test_register_needs_an_entry_point() -> None:
    with pytest.raises(TypeError, match="entry_point"):
        register("test-none")


def run_python(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    paths = [str(p) for p in (extra_path, REPO_ROOT) if p is not None]
    env = {"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.slow
def test_fresh_process_makes_calculator_and_lists_envs() -> None:
    code = "import json; from agentrl.envs import make, list_envs; e = make('calculator'); print(json.dumps([type(e).__name__, list_envs()]))"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    name, ids = json.loads(out.stdout)
    assert name == "CalculatorEnv" and "calculator" in ids


@pytest.mark.slow
def test_entry_point_discovery_in_a_fresh_process(tmp_path: Path) -> None:
    """An installed package exposing an EnvSpec is found with no import of it by the user."""
    (tmp_path / "toy_env_pkg.py").write_text(
        textwrap.dedent(
            """
            from agentrl.envs import AgentEnv, EnvSpec

            class ToyEnv(AgentEnv):
                pass

            SPEC = EnvSpec("toy", "toy_env_pkg:ToyEnv", description="a toy")
            BROKEN = EnvSpec("other_name", "toy_env_pkg:ToyEnv")
            """
        )
    )
    dist = tmp_path / "toy_env_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-env-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[agentrl.envs]\ntoy = toy_env_pkg:SPEC\nmissing = toy_env_missing:SPEC\nmismatch = toy_env_pkg:BROKEN\n"
    )
    code = textwrap.dedent(
        """
        import json, sys
        from agentrl.envs import make, list_envs, spec
        ids = list_envs()
        imported_early = "toy_env_pkg" in sys.modules
        env = make("toy")
        errors = {}
        for env_id in ("missing", "mismatch"):
            try:
                spec(env_id)
            except ImportError as e:
                errors[env_id] = str(e)
        print(json.dumps([ids, imported_early, type(env).__name__, spec("toy").description, errors]))
        """
    )
    out = run_python(code, extra_path=tmp_path)
    assert out.returncode == 0, out.stderr
    ids, imported_early, name, description, errors = json.loads(out.stdout)
    assert {"toy", "missing", "mismatch", "calculator"} <= set(ids)
    assert not imported_early  # discovery reads metadata only
    assert (name, description) == ("ToyEnv", "a toy")
    assert "cannot import 'toy_env_missing'" in errors["missing"]
    assert "EnvSpec with id 'other_name'" in errors["mismatch"]


def test_builtin_envs_sit_beside_the_contract_and_load_on_first_use() -> None:
    """`import agentrl.envs` (the contract and the registry) imports no built-in env."""
    code = "import sys, agentrl.envs; print(sorted(m for m in sys.modules if '.builtin' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert spec("calculator").load_class().__module__ == "agentrl.envs.builtin.calculator"
    assert spec("slow_tools").load_class().__module__ == "agentrl.envs.builtin.slow_tools"
