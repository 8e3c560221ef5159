"""What `agentrl train` checks before its run directory is made: the agent, a resumed
checkpoint's pickles and loop state, and whether a resumed run has anything left to do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.config import RunConfig


def check_before_writing(cfg: RunConfig) -> dict[str, Any] | None:
    """What fails a run before its directory is made, in one line: the agent (it must import
    and be an `async def`) and, on resume, every pickle of the checkpoint. Returns the loop
    state a resume starts from (None for a new run)."""
    check_agent(cfg)
    if not cfg.checkpoint.resume:
        return None
    from agentrl.run.checkpoint import checkpoint_to_resume, read_loop_state
    from agentrl.trainer.checkpoint_safety import check_checkpoint

    ckpt = checkpoint_to_resume(cfg.checkpoint.resume)
    check_checkpoint(ckpt)
    return read_loop_state(ckpt)


def finished_line(cfg: RunConfig, loop_state: dict[str, Any]) -> str | None:
    """A resumed run whose steps are all trained, saved and evaluated has nothing to do: the
    line that says so (said before the model loads), else None."""
    step = int(loop_state["step"])
    evals = loop_state.get("evals") or []
    num_steps = max(cfg.train.num_rollout, step)  # the loop's count: a lowered --num-rollout too
    if step < num_steps or not evals or evals[-1].get("step") != step:
        return None
    run_dir = cfg.checkpoint.save
    return (
        f"{run_dir} is finished: step {step} of {num_steps} trained, saved and evaluated; nothing "
        f"to do (to train more: agentrl train --resume {run_dir} --override --num-rollout N)"
    )


def check_agent(cfg: RunConfig) -> None:
    """`--agent module:function` imports and is an `async def`, or a one-line ConfigError."""
    from agentrl.config import ConfigError

    if not cfg.rollout.agent:
        return
    from agentrl.agents import load_agent

    try:
        load_agent(cfg.rollout.agent)
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    except Exception as e:  # the agent's module ran and raised: its own error, one line
        raise ConfigError(
            f"rollout.agent={cfg.rollout.agent!r}: importing it raised "
            f"{type(e).__name__}: {' '.join(str(e).split())}; fix the module or pass "
            "another --agent"
        ) from None
