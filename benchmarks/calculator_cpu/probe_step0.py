"""Step-0 probe of the calculator env: what the untrained policy does on its first turn.

Runs the first N held-out problems greedy (1 episode each) and at a temperature (K episodes
each) through the real rollout path (LocalEngine, ChatCodec, the env), and counts: first
turns that call `calculate` (as the codec parsed them, and as the env read them), episodes
that got a tool result, accuracy, and accuracy among episodes that called.

    python benchmarks/calculator_cpu/probe_step0.py --kwargs '{"difficulty": 2}' \\
        --num-tasks 16 --samples 4 --temperature 0.7 --out benchmarks/calculator_cpu/NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any


async def _episodes(
    env: str, kwargs: dict[str, Any], num_tasks: int, n: int, temperature: float, sets
):
    from agentrl.config import config_from_flags
    from agentrl.data import load_tasks
    from agentrl.engine.factory import make_engine
    from agentrl.envs import spec
    from agentrl.rollout import build_runner

    cfg = config_from_flags(
        "calculator", {}, [f"env.id={env}", f"env.kwargs={json.dumps(kwargs)}", *sets]
    )
    tasks = load_tasks(cfg.env, "test", spec(cfg.env.id).load_class())[:num_tasks]
    engine = make_engine(cfg)
    try:
        runner = build_runner(cfg, engine)
        groups = [runner.run_group(t, n, temperature=temperature) for t in tasks]
        return [traj for group in await asyncio.gather(*groups) for traj in group]
    finally:
        await engine.close()


def summarize(trajs: list[Any]) -> dict[str, Any]:
    def called(t: Any) -> bool:
        return sum(turn.num_tool_calls for turn in t.turns) > 0

    statuses = Counter(t.status.value for t in trajs)
    trajs = [t for t in trajs if t.status.is_trainable]  # errors are not the policy's doing
    n = max(len(trajs), 1)
    first_opens = sum("<tool_call>" in t.turns[0].text for t in trajs if t.turns)
    callers = [t for t in trajs if called(t)]
    correct = [bool(t.info.get("correct")) for t in trajs]
    return {
        "episodes": len(trajs),
        "statuses": dict(statuses),
        "first_turn_writes_tool_call_tag": first_opens / n,
        "episodes_with_tool_call": len(callers) / n,
        "accuracy": sum(correct) / n,
        "accuracy_when_called": (
            sum(bool(t.info.get("correct")) for t in callers) / len(callers) if callers else 0.0
        ),
        "mean_reward": sum(t.reward for t in trajs) / n,
        "tool_errors_per_episode": sum(turn.num_tool_errors for t in trajs for turn in t.turns) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="calculator", help="env id (or module:Class)")
    parser.add_argument("--kwargs", default="{}", help="env kwargs as JSON")
    parser.add_argument("--num-tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="episodes per task when sampled")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", required=True, help="path prefix for NAME.json and NAME.txt")
    args = parser.parse_args()
    kwargs = json.loads(args.kwargs)
    report: dict[str, Any] = {"env": args.env, "env_kwargs": kwargs, "sets": args.sets}
    lines: list[str] = []
    for label, temp, n in (
        ("greedy", 0.0, 1),
        (f"t{args.temperature}", args.temperature, args.samples),
    ):
        trajs = asyncio.run(_episodes(args.env, kwargs, args.num_tasks, n, temp, args.sets))
        report[label] = summarize(trajs)
        lines.append(f"== {label}: {json.dumps(report[label])}")
        for t in trajs:
            data = t.task["data"]
            lines.append(
                f"-- {data['question']} [gold {data['answer']}] reward {t.reward:g} "
                f"{t.status.value}/{t.status_reason.value} {t.info.get('error', '')[-300:]}"
            )
            lines.extend(f"   turn: {turn.text!r}" for turn in t.turns)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(args.out + ".txt").write_text("\n".join(lines) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
