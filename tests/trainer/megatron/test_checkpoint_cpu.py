"""A Megatron checkpoint taken before the first update (a step-0 SIGTERM, a first step whose
groups all tied) holds no optimizer state, resumes, and changes no later step: training from it
is bit-identical to never saving, also into an optimizer that had stepped (bf16: its fp32
master copies are retaken from the loaded weights)."""

from __future__ import annotations

import json

import pytest
import torch
from test_backend_cpu import _batch, _groups, _megatron

pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


def _two_steps(backend) -> dict[str, torch.Tensor]:
    for seed in (0, 1):
        backend.train_step(_batch(_groups(96, seed=seed), backend.pad_id))
    return dict(kv for bucket in backend.export_weights() for kv in bucket)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_save_before_the_first_update_resumes_and_changes_no_step(configs, tmp_path, dtype):
    from conftest import save_random_model

    save_random_model(configs["llama"](), tmp_path / "hf")
    clean = _two_steps(_megatron(tmp_path / "hf", dtype, lr=1e-2))
    saved = _megatron(tmp_path / "hf", dtype, lr=1e-2)
    saved.save(tmp_path / "step0")
    state = json.loads((tmp_path / "step0" / "trainer_state.json").read_text())
    assert state["has_optimizer_state"] is False
    assert _equal(clean, _two_steps(saved))
    resumed = _megatron(tmp_path / "hf", dtype, lr=1e-2)
    resumed.load(tmp_path / "step0")  # failed: the optimizer's keys were not in the files
    assert _equal(clean, _two_steps(resumed))
    stepped = _megatron(tmp_path / "hf", dtype, lr=1e-2)
    stepped.train_step(_batch(_groups(96, seed=5), stepped.pad_id))
    stepped.load(tmp_path / "step0")
    assert _equal(clean, _two_steps(stepped))


class _Marker:
    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("planted", ["megatron/.metadata", "megatron/common.pt"])
def test_a_pickle_planted_in_a_megatron_checkpoint_never_runs(configs, tmp_path, planted):
    """dist_checkpointing unpickles .metadata with pickle.load and its items unrestricted: the
    backend's load checks every pickle first and refuses in one line."""
    import pickle

    from conftest import save_random_model

    from agentrl.trainer.checkpoint_safety import UnsafeCheckpointError

    save_random_model(configs["llama"](), tmp_path / "hf")
    backend = _megatron(tmp_path / "hf", "float32", lr=1e-2)
    backend.save(tmp_path / "step")
    backend.load(tmp_path / "step")  # as saved, it loads
    marker = tmp_path / "marker"
    target = tmp_path / "step" / planted
    if planted.endswith(".pt"):
        torch.save(_Marker(marker), target)
    else:
        target.write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(UnsafeCheckpointError, match=planted.split("/")[1]):
        backend.load(tmp_path / "step")
    assert not marker.exists()
