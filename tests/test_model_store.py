"""Model store: path resolution, the cached SmolLM2 conversion, loading, and the tiny test model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from agentrl.model_store import (
    ModelPathError,
    eos_token_ids,
    load_model_and_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from tests.support.models import make_tiny_model


def test_existing_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_a_directory_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="has no config.json, so it is not a transformers"):
        resolve_model_path(str(tmp_path))


def test_a_lora_adapter_directory_is_named_as_one(tmp_path: Path) -> None:
    """A LoRA run's checkpoint holds the adapter, not a model (issue 41)."""
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(
        ModelPathError, match="is a LoRA adapter .adapter_config.json., not a whole"
    ):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("value", ["no-such-model", "/definitely/missing/dir"])
def test_unknown_name_or_missing_path_names_value_and_choices(value: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model_path(value)
    assert repr(value) in str(err.value)
    assert "smollm2-135m-instruct" in str(err.value)


def _fake_checkpoint(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")


def test_cached_conversion_is_reused_from_cache_dir_argument(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "smollm2-135m-instruct")
    assert resolve_model_path("default", cache_dir=str(tmp_path)) == str(
        tmp_path / "smollm2-135m-instruct"
    )


def test_cache_dir_falls_back_to_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_checkpoint(tmp_path / "smollm2-135m-instruct")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    assert resolve_model_path("smollm2-135m-instruct") == str(tmp_path / "smollm2-135m-instruct")


@pytest.mark.parametrize(
    ("tokenizer_eos", "config_eos", "expected"),
    [
        (2, None, [2]),
        (None, None, []),
        (2, 7, [2, 7]),
        (2, [2, 7, 9], [2, 7, 9]),  # each id once, the tokenizer's first
        (None, [9, 7], [9, 7]),
    ],
)
def test_eos_token_ids_merge_tokenizer_and_generation_config(
    tokenizer_eos, config_eos, expected
) -> None:
    tokenizer = type("Tok", (), {"eos_token_id": tokenizer_eos})()
    config = type("GenerationConfig", (), {"eos_token_id": config_eos})()
    assert eos_token_ids(tokenizer, config) == expected
    assert eos_token_ids(tokenizer) == ([] if tokenizer_eos is None else [tokenizer_eos])


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", "cpu")


def test_converted_smollm2_keeps_chat_template_and_eos(smollm2_path: str) -> None:
    model, tokenizer = load_model_and_tokenizer(smollm2_path, device="cpu")
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert not hasattr(model.config, "quantization_config")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert ids.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_smollm2_answers_sensibly(smollm2_path: str) -> None:
    model, tokenizer = load_model_and_tokenizer(smollm2_path, device="cpu")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    out = model.generate(prompt, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1] :])
    assert "Paris" in answer
    assert answer.endswith("<|im_end|>")


def test_tiny_model_shares_tokenizer_and_is_seeded(smollm2_path: str, tmp_path: Path) -> None:
    make_tiny_model(str(tmp_path / "a"), smollm2_path, seed=3)
    make_tiny_model(str(tmp_path / "b"), smollm2_path, seed=3)
    a, tok_a = load_model_and_tokenizer(str(tmp_path / "a"), device="cpu")
    b, _ = load_model_and_tokenizer(str(tmp_path / "b"), device="cpu")
    tok_src = AutoTokenizer.from_pretrained(smollm2_path)
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64
    assert a.config.vocab_size == len(tok_src)
    assert tok_a.chat_template == tok_src.chat_template
    assert tok_a.eos_token_id == tok_src.eos_token_id
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
