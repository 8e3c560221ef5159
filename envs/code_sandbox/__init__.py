"""`code_sandbox`: HumanEval-style coding with a sandboxed `run_python` tool and hidden tests
graded so that exiting early, overriding `__eq__` or patching the harness earn nothing."""

from agentrl.envs import EnvSpec

SPEC = EnvSpec(
    id="code_sandbox",
    entry_point="agentrl_envs.code_sandbox.env:CodeSandboxEnv",
    description="Write a Python function (HumanEval); run code in a sandbox; reward from hidden tests.",
)

__all__ = ["SPEC"]
