"""Every change agentrl makes to megatron-core's code, installed together by `install_all` when a
`MegatronBackend` sets up, and logged (INFO) one line each:

- `saver_compat`: megatron.core imported past a `torch_memory_saver` that a colocated engine has
  initialised (done at import, which it is for; only logged here);
- `rope`: the unfused THD rotary embedding in one pass, without host syncs;
- `multi_tensor`: foreach kernels where megatron-core fell back to its Python loops;
- `wgrad`: weight gradients accumulated in fp32 by the GEMM, on CUDA, without Apex.

Not patches: `attention.PackedCoreAttention` fills a slot of megatron-core's layer spec, and
`optimizers` sets torch's Adam to its fused form through the optimizer's own options."""

from __future__ import annotations

import logging

import torch

from agentrl.trainer.megatron import multi_tensor, rope, saver_compat, wgrad

logger = logging.getLogger(__name__)


def install_all(device: torch.device) -> bool:
    """Install every patch (each is idempotent) for a model on `device`; log what is patched.
    Whether megatron's gradient_accumulation_fusion can be on (Apex's or ours)."""
    patched: list[str] = []
    if saver_compat.was_needed:
        patched.append(
            "torch_memory_saver.hook_mode: megatron.core imported past the initialised "
            "saver (saver_compat.py)"
        )
    rope.install()
    patched.append(
        "megatron.core rope_utils._apply_rotary_pos_emb_thd: packed RoPE in one pass (rope.py)"
    )
    patched += [f"{slot}: foreach kernels (multi_tensor.py)" for slot in multi_tensor.install()]
    has_wgrad_fusion = wgrad.install(device)
    if wgrad.is_installed():
        patched.append(
            "megatron.core tensor_parallel.layers.fused_weight_gradient_mlp_cuda: "
            "torch.addmm into fp32 main_grad (wgrad.py)"
        )
    for line in patched:
        logger.info("patched %s", line)
    return has_wgrad_fusion
