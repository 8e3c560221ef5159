"""`patches.install_all`: every change agentrl makes to megatron-core's code is installed at a
backend's setup, not by importing a module, and each is logged at INFO."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

# The module first: it imports megatron-core past a memory saver another test initialised.
patches = pytest.importorskip("agentrl.trainer.megatron.patches")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.optimizer import optimizer as megatron_optimizer  # noqa: E402

from agentrl.trainer.megatron import multi_tensor, rope  # noqa: E402


def test_importing_the_backend_patches_nothing():
    code = (
        "import agentrl.trainer.megatron.backend\n"
        "from megatron.core.models.common.embeddings import rope_utils\n"
        "from megatron.core.optimizer import clip_grads\n"
        "from agentrl.trainer.megatron import rope, multi_tensor\n"
        "assert rope_utils._apply_rotary_pos_emb_thd is not rope.apply_rotary_pos_emb_thd\n"
        "assert clip_grads.l2_norm_impl is not multi_tensor.multi_tensor_l2norm\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_install_all_installs_and_logs_each_patch(caplog):
    with caplog.at_level(logging.INFO, logger=patches.__name__):
        has_wgrad_fusion = patches.install_all(torch.device("cpu"))
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rotary_pos_emb_thd
    for module, name, ours in (
        (clip_grads, "l2_norm_impl", multi_tensor.multi_tensor_l2norm),
        (clip_grads, "multi_tensor_scale_impl", multi_tensor.multi_tensor_scale),
        (megatron_optimizer, "multi_tensor_scale_impl", multi_tensor.multi_tensor_scale),
    ):
        current = getattr(module, name)
        # Apex's or TransformerEngine's kernels stay; megatron's local loops are replaced.
        assert current is ours or current.__module__.split(".")[0] in (
            "amp_C",
            "transformer_engine",
        )
    assert has_wgrad_fusion is False  # on the CPU megatron's own accumulation runs
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines and all(line.startswith("patched ") for line in lines)
    assert any("_apply_rotary_pos_emb_thd" in line for line in lines)
    if clip_grads.l2_norm_impl is multi_tensor.multi_tensor_l2norm:
        assert any("clip_grads.l2_norm_impl" in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=patches.__name__):
        again = patches.install_all(torch.device("cpu"))  # idempotent: the same patches in place
    assert again is False
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == lines
