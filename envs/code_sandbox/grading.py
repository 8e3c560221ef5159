"""Hidden-test grading: a fresh sandbox per grade, tests and solution in separate processes,
typed results, and a per-run nonce that only the trusted harness can print.

Why each hole is closed: `os._exit(0)` / `sys.exit(0)` in the solution end only the worker
(the harness scores those calls as failures); an always-true `__eq__` cannot be serialised;
patching builtins or the test code touches the worker's memory, never the harness's; and no
result counts unless its line starts with the nonce, which the worker never sees.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.tools.sandbox import Limits, Program, Sandbox, SandboxResult, SandboxStatus

_DATA = Path(__file__).parent / "data"
HARNESS_FILES = {name: (_DATA / name).read_text() for name in ("codec.py", "worker.py")}
HARNESS_MAIN = (_DATA / "harness.py").read_text()
DEFAULT_GRADE_LIMITS = Limits(timeout_s=30.0, memory_mb=512, max_processes=32)


class SandboxInfraError(RuntimeError):
    """The sandbox itself failed: an infrastructure error, never a reward of 0."""


@dataclass
class GradeResult:
    passed: list[bool] = field(default_factory=list)
    is_verified: bool = False
    """The nonce line came back: the harness ran to its end."""
    sandbox: SandboxResult | None = None
    error: str | None = None

    @property
    def num_tests(self) -> int:
        return len(self.passed)

    @property
    def num_passed(self) -> int:
        return sum(self.passed)

    @property
    def all_passed(self) -> bool:
        return self.is_verified and self.num_tests > 0 and all(self.passed)

    @property
    def fraction_passed(self) -> float:
        return self.num_passed / self.num_tests if self.is_verified and self.num_tests else 0.0


async def grade(
    sandbox: Sandbox,
    *,
    solution: str,
    prompt: str,
    test: str,
    entry_point: str,
    limits: Limits | None = None,
    call_timeout_s: float = 5.0,
) -> GradeResult:
    """Run `test` (a HumanEval-style `check(candidate)`) against `solution`, whose module must
    define `entry_point`. Raises SandboxInfraError when the sandbox broke."""
    nonce = secrets.token_hex(16)
    config = {
        "nonce": nonce,
        "prompt": prompt,
        "test": test,
        "entry_point": entry_point,
        "call_timeout_s": call_timeout_s,
    }
    program = Program(
        code=HARNESS_MAIN,
        files={**HARNESS_FILES, "solution.py": solution},
        stdin=json.dumps(config),
    )
    result = await sandbox.run(program, limits or DEFAULT_GRADE_LIMITS)
    if result.status is SandboxStatus.SANDBOX_ERROR:
        raise SandboxInfraError(f"grading sandbox failed: {result.error}")
    return _parse(result, nonce)


def _parse(result: SandboxResult, nonce: str) -> GradeResult:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce + " "):
            report: dict[str, Any] = json.loads(line[len(nonce) + 1 :])
            return GradeResult([bool(p) for p in report["passed"]], True, result)
    why = result.error or (result.stderr.strip().splitlines() or ["no result line"])[-1]
    return GradeResult([], False, result, f"harness did not finish ({result.status.value}): {why}")


def program_for(task_data: dict[str, Any], code: str) -> str:
    """The module to grade: the submitted code if it defines the entry point, else the prompt
    with the code appended (a HumanEval-style completion of the function body)."""
    entry_point = task_data["entry_point"]
    if f"def {entry_point}(" in code:
        return code
    return task_data["prompt"] + code
