"""Grading: every HumanEval canonical solution passes; every known cheat earns nothing."""

from __future__ import annotations

import asyncio

import pytest
from agentrl_envs.code_sandbox.grading import grade, program_for
from agentrl_envs.code_sandbox.tasks import humaneval_rows

ADD = {
    "prompt": 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
    "    assert candidate(10, 5) == 15\n",
}
CORRECT = "def add(a, b):\n    return a + b\n"
CHEATS = {
    "empty_body": ADD["prompt"],
    "os_exit_at_import": "import os\nos._exit(0)\ndef add(a, b):\n    return -7\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys_exit_at_import": "import sys\nsys.exit(0)\n",
    "always_equal": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
        "def add(a, b):\n    return Anything()\n"
    ),
    "int_subclass_equal": "class I(int):\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return I(-7)\n",
    "patch_assert_and_harness": (
        "import builtins, sys\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "for m in list(sys.modules.values()):\n    for name in ('run_tests', 'check', 'encode', 'decode'):\n"
        "        if hasattr(m, name):\n            setattr(m, name, lambda *a, **k: True)\n"
        "def add(a, b):\n    return -7\n"
    ),
    "fake_result_lines": (
        "import os, json\nline = json.dumps({'passed': [True, True, True]})\n"
        "for fd in (1, 2):\n    os.write(fd, ('0' * 32 + ' ' + line + '\\n').encode())\n"
        "try:\n    open('/proc/1/fd/1', 'w').write('x ' + line + '\\n')\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return -7\n"
    ),
    "kill_the_harness": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b):\n    return a + b\n",
    "read_harness_memory": (
        "import os\ntry:\n    open('/proc/%d/mem' % os.getppid(), 'rb').read(1)\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return -7\n"
    ),
}


async def test_correct_solution_passes(grading_sandbox) -> None:
    result = await grade(grading_sandbox, solution=CORRECT, **ADD)
    assert result.is_verified and result.all_passed and result.passed == [True, True, True]


@pytest.mark.parametrize("name", sorted(CHEATS))
async def test_cheat_earns_nothing(grading_sandbox, name: str) -> None:
    result = await grade(grading_sandbox, solution=CHEATS[name], **ADD)
    assert not result.all_passed, f"{name} passed: {result}"
    assert result.fraction_passed == 0.0, f"{name}: {result.passed}"


async def test_partial_solution_scores_a_fraction(grading_sandbox) -> None:
    partial = "def add(a, b):\n    return {1: 3, -1: 0}.get(a, 0)\n"  # right on tests 1 and 2 only
    result = await grade(grading_sandbox, solution=partial, **ADD)
    assert result.passed == [True, True, False] and result.fraction_passed == pytest.approx(2 / 3)


async def test_slow_call_times_out_without_hanging_the_grade(grading_sandbox) -> None:
    slow = (
        "import time\ndef add(a, b):\n    if a == -1:\n        time.sleep(60)\n    return a + b\n"
    )
    result = await grade(grading_sandbox, solution=slow, call_timeout_s=1.0, **ADD)
    assert result.passed == [True, False, True]


@pytest.mark.slow
async def test_all_humaneval_canonical_solutions_pass(grading_sandbox) -> None:
    rows = humaneval_rows()
    assert len(rows) == 164

    async def one(row):
        solution = program_for(row, row["canonical_solution"])
        return row["task_id"], await grade(
            grading_sandbox,
            solution=solution,
            prompt=row["prompt"],
            test=row["test"],
            entry_point=row["entry_point"],
        )

    results = await asyncio.gather(*(one(r) for r in rows))
    failed = {task_id: (r.passed, r.error) for task_id, r in results if not r.all_passed}
    assert failed == {}
