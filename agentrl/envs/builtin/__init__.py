"""The built-in envs, `calculator` and `slow_tools`: small, dependency-free users of the env
contract (`agentrl.envs.base`), kept beside it rather than inside it. `agentrl.envs` registers
them by lazy `"module:Class"` ids, as any installed package would."""
