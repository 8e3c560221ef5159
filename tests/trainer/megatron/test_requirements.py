"""`--train-backend megatron` fails at once, naming the field, the value and the fix, where it
cannot run: without megatron-core, without CUDA, or with parallel sizes that do not fit."""

from __future__ import annotations

import pytest

from agentrl.config import TrainConfig
from agentrl.trainer.megatron import MegatronUnavailable, check_megatron_usable, requirements


def test_missing_megatron_core_names_the_extra(monkeypatch):
    monkeypatch.setattr(requirements, "_installed", lambda module: False)
    with pytest.raises(MegatronUnavailable) as err:
        check_megatron_usable(TrainConfig(backend="megatron"))
    message = str(err.value)
    assert "train.backend='megatron' (--train-backend megatron)" in message
    assert "pip install 'agentrl[megatron]'" in message and "--train-backend torch" in message
    assert "\n" not in message


def test_no_cuda_says_so(monkeypatch):
    monkeypatch.setattr(requirements, "_installed", lambda module: True)
    monkeypatch.setattr(requirements, "_cuda_available", lambda: False)
    with pytest.raises(MegatronUnavailable, match="needs a CUDA GPU.*--train-backend torch"):
        check_megatron_usable(TrainConfig(backend="megatron"))


def test_this_machine_gets_the_true_answer():
    """No mocks: on a CPU machine (CI) one of the two messages, on a GPU with the extra none."""
    import torch

    if torch.cuda.is_available() and requirements._installed("megatron.core"):
        check_megatron_usable(TrainConfig(backend="megatron"))
        return
    with pytest.raises(MegatronUnavailable, match="--train-backend megatron"):
        check_megatron_usable(TrainConfig(backend="megatron"))


def test_parallel_sizes_must_fit_the_gpus(monkeypatch):
    monkeypatch.setattr(requirements, "_installed", lambda module: True)
    monkeypatch.setattr(requirements, "_cuda_available", lambda: True)
    cfg = TrainConfig(
        backend="megatron", tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    check_megatron_usable(cfg, num_gpus=8)
    with pytest.raises(MegatronUnavailable, match="= 4 does not divide the trainer's 6 GPUs"):
        check_megatron_usable(cfg, num_gpus=6)
    with pytest.raises(MegatronUnavailable, match="--sequence-parallel"):
        check_megatron_usable(TrainConfig(backend="megatron", sequence_parallel=True))


def test_sequence_parallel_needs_transformer_engine(monkeypatch):
    """The local layer spec (no TransformerEngine) builds torch norms that refuse sequence
    parallel; that is said before anything starts."""
    monkeypatch.setattr(requirements, "_installed", lambda module: True)
    monkeypatch.setattr(requirements, "_cuda_available", lambda: True)
    cfg = TrainConfig(backend="megatron", tensor_model_parallel_size=2, sequence_parallel=True)
    monkeypatch.setattr(requirements, "_installed", lambda module: module == "megatron.core")
    with pytest.raises(
        MegatronUnavailable, match="needs TransformerEngine.*drop --sequence-parallel"
    ):
        check_megatron_usable(cfg, num_gpus=2)
    monkeypatch.setattr(requirements, "_installed", lambda module: True)
    check_megatron_usable(cfg, num_gpus=2)
