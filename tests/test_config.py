from __future__ import annotations

import pytest

from agentrl.config import ConfigError, RunConfig, apply_overrides, recipe_for_env, set_field


def test_override_sets_typed_values():
    cfg = apply_overrides(
        RunConfig(), ["train.lr=3e-6", "rollout.n_samples_per_prompt=8", "algo.use_kl_loss=true"]
    )
    assert cfg.train.lr == 3e-6
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.algo.use_kl_loss is True


def test_optional_and_literal_fields():
    cfg = apply_overrides(RunConfig(), ["algo.eps_clip_high=0.28", "algo.advantage_estimator=rloo"])
    assert cfg.algo.eps_clip_high == 0.28
    assert cfg.algo.advantage_estimator == "rloo"
    apply_overrides(cfg, ["algo.eps_clip_high=none"])
    assert cfg.algo.eps_clip_high is None


def test_dict_and_list_fields():
    cfg = apply_overrides(
        RunConfig(), ["env.kwargs.max_turns=3", 'engine.sglang_args=["--context-length", "4096"]']
    )
    assert cfg.env.kwargs == {"max_turns": 3}
    assert cfg.engine.sglang_args == ["--context-length", "4096"]


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("train.lrr=1", "unknown field 'train.lrr'"),
        ("trian.lr=1", "unknown config section 'trian'"),
        ("train.num_rollout=ten", "'ten' is not an integer"),
        ("algo.advantage_estimator=ppo", "choose one of: grpo, rloo"),
        ("algo.use_kl_loss=maybe", "not a boolean"),
        ("train.lr", "needs a value"),
        ("lr=1", "section.field=value"),
    ],
)
def test_bad_override_names_field_and_value(override, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        apply_overrides(RunConfig(), [override])
    assert fragment in str(e.value)


def test_round_trip_through_dict():
    cfg = recipe_for_env("search_r1")
    set_field(cfg, "train.lr", 5e-7)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_recipe_for_unknown_env_keeps_defaults():
    cfg = recipe_for_env("my_env")
    assert cfg.env.id == "my_env"
    assert cfg.rollout == RunConfig().rollout


def test_an_installed_package_contributes_the_recipe_of_its_env(tmp_path, monkeypatch):
    (tmp_path / "toy_recipes.py").write_text(
        "from agentrl.config import RunConfig\n\n"
        "def recipe():\n    cfg = RunConfig()\n    cfg.env.id = 'toy'\n"
        "    cfg.train.num_rollout = 3\n    return cfg\n"
    )
    dist = tmp_path / "toy_recipes-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-recipes\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[agentrl.recipes]\ntoy = toy_recipes:recipe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert recipe_for_env("toy").train.num_rollout == 3
    assert recipe_for_env("search_r1").env.kwargs["reward"] == "format"  # the bundled env's own
