from __future__ import annotations

import importlib.util
import re

import pytest

from agentrl.config import (
    ConfigError,
    EnvConfig,
    RunConfig,
    apply_overrides,
    recipe_for_env,
    set_field,
)
from agentrl.config_checks import check_run, resolved


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
        (
            "train.lr=-1e-6",
            "train.lr='-1e-6' is out of range: it must be greater than or equal to 0",
        ),
        ("rollout.n_samples_per_prompt=0", "is out of range: it must be greater than 0"),
        ("rollout.rollout_top_p=1.5", "rollout_top_p='1.5' is out of range: it must be less than"),
        ("algo.eps_clip_c=0.9", "eps_clip_c='0.9' is out of range: it must be greater than 1"),
        ("train.max_staleness=-1", "max_staleness='-1' is out of range"),
        ("cluster.update_weight_buffer_size=0", "update_weight_buffer_size='0' is out of range"),
    ],
)
def test_bad_override_names_field_and_value(override, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        apply_overrides(RunConfig(), [override])
    assert fragment in str(e.value)


def test_bounds_keep_their_edge_values_and_none():
    cfg = apply_overrides(
        RunConfig(),
        ["train.lr=0", "rollout.rollout_top_p=1", "train.max_staleness=0",
         "train.max_staleness=none", "rollout.rollout_top_k=-1", "engine.mem_fraction_static=1"],
    )  # fmt: skip
    assert cfg.train.lr == 0 and cfg.rollout.rollout_top_p == 1 and cfg.train.max_staleness is None
    assert cfg.rollout.rollout_top_k == -1 and cfg.engine.mem_fraction_static == 1


def test_a_saved_config_out_of_range_is_refused_on_load():
    """A hand-edited run_config.json goes through the same checks as the command line."""
    data = RunConfig().to_dict()
    data["rollout"]["rollout_batch_size"] = 0
    with pytest.raises(ConfigError, match="rollout.rollout_batch_size=0 is out of range"):
        RunConfig.from_dict(data)


def test_round_trip_through_dict():
    cfg = recipe_for_env("search_r1")
    set_field(cfg, "train.lr", 5e-7)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_a_recipe_less_env_gets_the_calculators_modest_settings():
    """RunConfig's own 4 turns x 256 tokens at temperature 1.0 took 4.5 min for one CPU step
    of README's own env and trained 0 tokens (issue 39)."""
    cfg = recipe_for_env("my_env:CapitalsEnv")
    calculator = recipe_for_env("calculator")
    assert cfg.env == EnvConfig(id="my_env:CapitalsEnv")
    assert cfg.rollout == calculator.rollout and cfg.train == calculator.train
    assert cfg.eval == calculator.eval
    assert (cfg.rollout.max_turns, cfg.rollout.rollout_max_response_len) == (3, 64)
    assert cfg.rollout.rollout_temperature == 0.8
    assert cfg.checkpoint.save == RunConfig().checkpoint.save  # not runs/calculator


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["engine.url=http://127.0.0.1:30000"],
         "engine.url='http://127.0.0.1:30000' is set but engine.kind=local ignores it; add --set "
         "engine.kind=http"),
        (["engine.kind=sglang", "engine.url=http://h:1"], "engine.kind=sglang ignores it"),
        (["rollout.n_samples_per_prompt=1"],
         "--n-samples-per-prompt 1 leaves --advantage-estimator grpo no group"),
        (["rollout.n_samples_per_prompt=1", "algo.advantage_estimator=rloo"],
         "or --advantage-estimator reinforce_plus_plus"),
    ],
)  # fmt: skip
def test_a_setting_that_would_be_silently_ignored_or_useless_is_refused(overrides, named):
    """Issue 39: engine.url without engine.kind=http was ignored; one episode per task with a
    group-relative estimator started a run whose advantages had no baseline."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_run(apply_overrides(recipe_for_env("calculator"), overrides))


def test_one_episode_per_task_is_fine_for_an_estimator_that_whitens_the_batch():
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        overrides = ["rollout.n_samples_per_prompt=1", f"algo.advantage_estimator={estimator}"]
        check_run(apply_overrides(recipe_for_env("calculator"), overrides))


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
    from agentrl_envs.search_r1.recipe import recipe as search_r1_recipe

    bundled = recipe_for_env("search_r1")  # the bundled env's own, not the default config
    assert bundled.env.kwargs["reward"] == search_r1_recipe().env.kwargs["reward"]
    assert bundled.env.kwargs != RunConfig().env.kwargs


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["engine.kind=http"], "engine.kind=http needs engine.url"),
        (["engine.kind=http", "engine.url=notaurl"], "engine.url='notaurl' must start with http"),
        (["train.tensor_model_parallel_size=2", "train.sequence_parallel=true"],
         "--tensor-model-parallel-size, --sequence-parallel need --train-backend megatron"),
        (["algo.eps_clip=0.3", "algo.eps_clip_high=0.1"], "--eps-clip-high=0.1 is below --eps-clip=0.3"),
        (["train.lr=1e-6", "train.min_lr=1e-5"], "train.min_lr=1e-05 is above --lr=1e-06"),
        (["rollout.rollout_max_response_len=5000"], "--rollout-max-response-len=5000 is more than"),
        (["cluster.ray_address=garbage"], "--ray-address='garbage' is not a Ray address"),
    ],
)  # fmt: skip
def test_contradicting_fields_are_refused_naming_them(overrides, named):
    cfg = apply_overrides(RunConfig(), overrides)
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_run(cfg)


def test_consistent_configs_pass():
    for env in ("calculator", "search_r1", "code_sandbox"):
        check_run(recipe_for_env(env))
    cfg = apply_overrides(RunConfig(), ["train.backend=megatron", "train.tensor_model_parallel_size=2",
                                        "cluster.ray_address=10.0.0.1:6379", "algo.eps_clip_high=0.28",
                                        "engine.kind=http", "engine.url=http://127.0.0.1:30000"])  # fmt: skip
    check_run(cfg)


def test_non_finite_numbers_are_refused():
    with pytest.raises(ConfigError, match="train.lr='inf' is not a finite number"):
        apply_overrides(RunConfig(), ["train.lr=inf"])


def test_a_replaced_field_names_its_replacement():
    with pytest.raises(ConfigError, match=r"engine.weight_update_path is gone; set "
                       r"cluster.update_weight_transport=distributed instead"):  # fmt: skip
        apply_overrides(RunConfig(), ["engine.weight_update_path=distributed"])
    saved = RunConfig().to_dict()
    saved["engine"]["weight_update_path"] = "tensor"  # a run saved before the change resumes
    assert RunConfig.from_dict(saved).cluster.update_weight_transport == "auto"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("engine.num_servers=2", "cluster.rollout_num_gpus"),
        ("engine.tp_size=2", "cluster.rollout_num_gpus_per_engine=2"),
        ("engine.restart_on_failure=true", "cluster.max_engine_restarts"),
        ("engine.router_policy=manual", "cluster.router_policy=manual"),
    ],
)
def test_the_engine_sections_old_server_knobs_name_their_one_spelling(old, new):
    """Issue 40: the launched servers' count, size, restarts and router live in cluster.*."""
    with pytest.raises(ConfigError, match=rf"^{old.split('=')[0]} is gone; set {re.escape(new)}"):
        apply_overrides(RunConfig(), [old])
    saved = RunConfig().to_dict()  # a run saved before the change resumes
    saved["engine"].update(num_servers=1, tp_size=1, restart_on_failure=False)
    saved["engine"]["router_policy"] = "consistent_hashing"
    assert RunConfig.from_dict(saved).cluster.rollout_num_gpus is None


def test_an_in_process_engine_takes_tensors_only():
    cfg = apply_overrides(RunConfig(), ["cluster.update_weight_transport=disk"])
    with pytest.raises(ConfigError, match="--update-weight-transport=disk needs engine servers"):
        check_run(cfg)
    check_run(apply_overrides(cfg, ["engine.kind=http", "engine.url=http://127.0.0.1:1"]))


def test_resolved_fills_tis_from_async_and_leaves_the_config_as_given():
    cfg = apply_overrides(RunConfig(), ["train.use_async=true"])
    assert resolved(cfg).algo.use_tis is True and cfg.algo.use_tis is None
    assert resolved(RunConfig()).algo.use_tis is False
    kept = apply_overrides(RunConfig(), ["train.use_async=true", "algo.use_tis=false"])
    assert resolved(kept).algo.use_tis is False


def test_calculator_recipe_carries_what_the_readme_agent_needs() -> None:
    """README's OpenAI-client agent makes up to three calls: the recipe allows three turns, so
    `agentrl train --env calculator --agent my_agent:run` needs no --set."""
    from agentrl.config import recipe_calculator

    assert recipe_calculator().rollout.max_turns == 3


def test_a_rollout_correction_without_tis_stays_without_it_under_async():
    """`--async` turns TIS on by default, but not on top of a correction asked for by name."""
    cfg = apply_overrides(RunConfig(), ["train.use_async=true", "algo.rollout_correction=geo_rs"])
    assert resolved(cfg).algo.use_tis is False


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algo.rollout_rs_threshold=1.5"], "algo.rollout_rs_threshold is set but algo.rollout_rs"),
        (
            [
                "algo.rollout_rs=token",
                "algo.rollout_rs_threshold=1.5",
                "algo.rollout_rs_threshold_lower=2",
            ],
            "algo.rollout_rs_threshold_lower=2.0 is not below algo.rollout_rs_threshold=1.5",
        ),
        (
            ["algo.rollout_correction=icepop", "algo.rollout_rs_threshold=0.4"],
            "algo.rollout_rs_threshold_lower=0.5 is not below algo.rollout_rs_threshold=0.4",
        ),
    ],
)
def test_rollout_rejection_bounds_that_keep_nothing_or_go_unread_are_refused(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_run(apply_overrides(RunConfig(), overrides))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["train.lora_alpha=32"],
            "--lora-alpha without --lora-rank trains no adapter (train.lora_rank=0 is full "
            "fine-tuning); add --lora-rank 16",
        ),
        (
            ["train.lora_rank=16", "train.backend=megatron", "train.sequence_parallel=true"],
            "--lora-rank=16 on --train-backend megatron does not support "
            "--pipeline-model-parallel-size > 1 or --sequence-parallel yet",
        ),
        (
            ["train.lora_rank=16", "train.lora_target_modules=all-linear,q_proj"],
            "--lora-target-modules='all-linear,q_proj' must be all-linear alone",
        ),
        (
            ["train.lora_rank=16", "train.lora_target_modules=q_proj,lm_head"],
            "--lora-target-modules names 'lm_head', which cannot take an adapter here",
        ),
        (
            ["train.lora_rank=16", "train.lora_target_modules=model.*"],
            "--lora-target-modules names 'model.*'",
        ),
        (["train.lora_rank=-1"], "train.lora_rank='-1' is out of range"),
        (
            ["train.lora_rank=8", "train.lora_dropout=1.5"],
            "train.lora_dropout='1.5' is out of range",
        ),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_in_one_line(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)) as caught:
        check_run(apply_overrides(recipe_for_env("calculator"), overrides))
    assert "\n" not in str(caught.value)


def test_lora_settings_reach_the_train_section(monkeypatch):
    overrides = [
        "train.lora_rank=16",
        "train.lora_alpha=32",
        "train.lora_dropout=0.05",
        "train.lora_target_modules=linear_qkv,linear_proj",
    ]
    cfg = apply_overrides(recipe_for_env("calculator"), overrides)
    check_run(cfg)
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_dropout) == (16, 32, 0.05)
    assert cfg.train.lora_target_modules == ["linear_qkv", "linear_proj"]
    assert RunConfig.from_dict(cfg.to_dict()).train == cfg.train  # a saved run's config
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "peft" else real_find_spec(name)
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "--lora-rank=16 needs peft, which is not installed: pip install 'agentrl[lora]'"
        ),
    ):
        check_run(cfg)
