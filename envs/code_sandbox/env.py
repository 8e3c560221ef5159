"""`code_sandbox`: write a Python function, try code with the sandboxed `run_python` tool, then
submit it (a message without tool calls; its last ```python block). Hidden tests set the reward:
1.0 if all pass (`reward="all_pass"`) or the fraction passed (`reward="fraction"`)."""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar, Literal

from agentrl_envs.code_sandbox import tasks as task_data
from agentrl_envs.code_sandbox.grading import grade, program_for

from agentrl.envs import AgentEnv, StepResult
from agentrl.envs.base import tool_info
from agentrl.tools import tool
from agentrl.tools.sandbox import Leases, Limits, Program, Sandbox, SandboxStatus, make_sandbox
from agentrl.types import Message, Task

SYSTEM_PROMPT = (
    "You write Python functions. You can run Python code with the run_python tool to test ideas; "
    "it returns the status, stdout and stderr. Call it like this:\n"
    '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1 + 1)"}}\n</tool_call>\n'
    "When you are done, reply without a tool call and put your complete solution (the whole "
    "function, with its imports) in one ```python code block."
)
USER_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}```"
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_SANDBOXES: dict[tuple[str, int | None], Sandbox] = {}


def shared_sandbox(backend: str, max_concurrency: int | None = None) -> Sandbox:
    """One sandbox per (backend, cap) per process: every env instance shares its leases (and
    Docker's warm pool). The cap defaults to the global one ($AGENTRL_SANDBOX_CONCURRENCY,
    else the CPU count), separate from how many episodes run at once."""
    key = (backend, max_concurrency)
    if key not in _SANDBOXES:
        leases = Leases(max_concurrency) if max_concurrency else None
        _SANDBOXES[key] = make_sandbox(backend, leases=leases)
    return _SANDBOXES[key]


def extract_code(text: str) -> str | None:
    """The last fenced code block of a message, or None."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def format_run(
    status: SandboxStatus, exit_code: int | None, stdout: str, stderr: str, truncated: bool
) -> str:
    lines = [f"status: {status.value}", f"exit_code: {exit_code}"]
    lines += [
        f"stdout:\n{stdout}" if stdout else "stdout: (empty)",
        f"stderr:\n{stderr}" if stderr else "stderr: (empty)",
    ]
    if truncated:
        lines.append("(output truncated)")
    return "\n".join(lines)


class CodeSandboxEnv(AgentEnv):
    """HumanEval-style coding with a sandboxed `run_python` tool and hidden-test grading.

    A solution may be a whole module defining the function or just its body (appended to the
    prompt). Pick the backend in config: `--set env.kwargs.sandbox_backend=docker` (auto |
    bubblewrap | docker); `max_concurrent_sandboxes` caps sandboxes apart from episodes. A
    broken sandbox raises (an infrastructure ERROR episode), never a reward of 0.
    """

    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    metadata: ClassVar[dict[str, Any]] = {
        "description": "write a Python function; sandboxed run_python; hidden tests"
    }

    def __init__(
        self,
        *,
        sandbox_backend: str = "auto",
        max_concurrent_sandboxes: int | None = None,
        reward: Literal["all_pass", "fraction"] = "all_pass",
        run_limits: Limits | None = None,
        grade_limits: Limits | None = None,
        max_output_chars: int = 4000,
    ) -> None:
        super().__init__()
        if reward not in ("all_pass", "fraction"):
            raise ValueError(f"code_sandbox reward={reward!r}: use 'all_pass' or 'fraction'")
        self.sandbox_backend = sandbox_backend
        self.max_concurrent_sandboxes = max_concurrent_sandboxes
        self.reward_kind = reward
        self.run_limits = run_limits or Limits(
            timeout_s=10.0, memory_mb=512, max_output_bytes=64 << 10
        )
        self.grade_limits = grade_limits
        self.max_output_chars = max_output_chars
        self.task: Task | None = None
        self.tools.register(self.run_python)

    @tool(timeout_s=60.0, max_output_tokens=1024)
    async def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox (no network, 10 s, 512 MB) and return its status, stdout and stderr.

        Args:
            code: The complete program to run; print what you want to see.
        """
        result = await self._sandbox().run(Program(code=code), self.run_limits)
        if result.status is SandboxStatus.SANDBOX_ERROR:
            raise RuntimeError(f"the sandbox failed (not your code): {result.error}")
        cap = self.max_output_chars
        cut = len(result.stdout) > cap or len(result.stderr) > cap
        return format_run(
            result.status,
            result.exit_code,
            result.stdout[:cap],
            result.stderr[-cap:],
            result.truncated or cut,
        )

    def _sandbox(self) -> Sandbox:
        return shared_sandbox(self.sandbox_backend, self.max_concurrent_sandboxes)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task = (options or {}).get("task")
        if task is None:  # no dataset row: pick a train task from the seed
            train = self.load_tasks("train")
            task = train[random.Random(seed).randrange(len(train))]
        self.task = task
        messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=USER_TEMPLATE.format(prompt=task.data["prompt"])),
        ]
        return messages, {"task_id": task.id}

    async def step(self, action: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("code_sandbox: step() before reset()")
        if action.tool_calls:
            results = await self.call_tools(action)
            return StepResult(observation=[r.message for r in results], info=tool_info(results))
        return await self._submit(action.content)

    async def _submit(self, content: str) -> StepResult:
        assert self.task is not None
        code = extract_code(content)
        info: dict[str, Any] = {"has_code_block": code is not None, **tool_info([])}
        if code is None:
            return StepResult(
                reward=0.0, terminated=True, info={**info, "num_tests": 0, "num_passed": 0}
            )
        data = self.task.data
        result = await grade(
            self._sandbox(),
            solution=program_for(data, code),
            prompt=data["prompt"],
            test=data["test"],
            entry_point=data["entry_point"],
            limits=self.grade_limits,
        )
        reward = (
            result.fraction_passed if self.reward_kind == "fraction" else float(result.all_passed)
        )
        info.update(
            num_tests=result.num_tests,
            num_passed=result.num_passed,
            all_passed=result.all_passed,
            is_verified=result.is_verified,
            grade_error=result.error,
        )
        return StepResult(reward=reward, terminated=True, info=info)

    @classmethod
    def load_tasks(
        cls,
        split: str,
        *,
        seed: int = 0,
        test_fraction: float = task_data.TEST_FRACTION,
        num_tasks: int | None = None,
    ) -> list[Task]:
        """HumanEval: "train" (131 tasks) and "test" (33), a seeded split; "all" (164)."""
        return task_data.load_humaneval(
            split, seed=seed, test_fraction=test_fraction, num_tasks=num_tasks
        )

    @classmethod
    def task_from_row(
        cls,
        row: dict[str, Any],
        *,
        index: int,
        input_key: str | None = None,
        label_key: str | None = None,
    ) -> Task:
        """A JSONL row with `prompt`, `entry_point` and `test` (HumanEval's shape); `label_key` is unused."""
        return task_data.task_from_row(row, index=index, input_key=input_key)
