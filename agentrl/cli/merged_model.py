"""A LoRA checkpoint's adapter merged into its base as a transformers model directory: what
`agentrl export --merge` writes and what `agentrl eval --checkpoint` of a LoRA checkpoint loads."""

from __future__ import annotations

import json
from pathlib import Path


def is_lora_adapter(model_dir: Path) -> bool:
    """A PEFT adapter directory (a LoRA checkpoint's model/), not a whole model."""
    from agentrl.trainer.lora import ADAPTER_CONFIG_FILE

    return (model_dir / ADAPTER_CONFIG_FILE).is_file() and not (model_dir / "config.json").is_file()


def merge_adapter(adapter_dir: Path, out: Path, *, base: str | None = None) -> None:
    """cast(W + alpha/r · B·A) in float32 per adapted weight (the formula of the trainer's sync and
    of the engine's merge, so the written model serves as they do), in the base's own dtype, with
    the base's config, generation config and the adapter directory's tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.engine.local.lora_merge import MergedAdapter
    from agentrl.trainer.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
    from agentrl.weights.adapter import AdapterExport

    if not is_lora_adapter(adapter_dir):
        raise ValueError(
            f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG_FILE}); export --merge takes "
            "the checkpoint of a run trained with --lora-rank"
        )
    config = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    base = base or config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(
            f"the adapter's base model {base!r} is not a directory here; pass --base PATH"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    adapter = AdapterExport(
        list(load_file(str(adapter_dir / ADAPTER_WEIGHTS_FILE)).items()), config
    )
    weights = model.state_dict(keep_vars=True)
    merger = MergedAdapter()
    merger.check(adapter, weights)
    merger.merge("export", adapter, weights)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(str(out))


def merged_for_eval(adapter_dir: Path) -> str:
    """The adapter merged into a temporary model directory, removed when the process exits (the
    engines load whole models)."""
    import atexit
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="agentrl-merged-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    merge_adapter(adapter_dir, out)
    return str(out)
