"""The Megatron-core trainer backend (`train.backend=megatron`, the `megatron` extra): tensor,
pipeline and data parallel training of Llama / Qwen2 / Qwen3 checkpoints with packed sequences.

Only this package imports `megatron.core`, and only its `backend`, `model`, `parallel`,
`checkpoint`, `optimizers`, `rope`, `multi_tensor` and `wgrad` modules do, each after
`saver_compat` (which lets the import past a `torch_memory_saver` that a colocated engine has
initialised). `patches.install_all` installs agentrl's changes to megatron-core's code at setup.
The rest (config and weight mapping, packing, vocab-parallel logprobs, packed attention) is plain
torch and runs on any machine."""

from __future__ import annotations

from agentrl.trainer.megatron.requirements import MegatronUnavailable, check_megatron_usable

__all__ = ["MegatronUnavailable", "check_megatron_usable"]
