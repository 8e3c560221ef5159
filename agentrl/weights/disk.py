"""The disk transport: a safetensors checkpoint directory each server loads with
`/update_weights_from_disk` (written by the sender rank, the model's config files beside it:
SGLang loads a whole directory)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from agentrl.weights.sender import Bucket, WeightTarget

_MODEL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
_MODEL_FILES += ["special_tokens_map.json", "chat_template.jinja"]


class DiskSender:
    def __init__(self, targets: Sequence[WeightTarget], model_path: str) -> None:
        self.targets = list(targets)
        self.model_path = model_path
        self.phases: dict[str, float] = defaultdict(float)
        self._dir: Path | None = None
        self._num_files = 0

    async def begin(self) -> None:
        self.phases = defaultdict(float)
        self._dir = Path(tempfile.mkdtemp(prefix="agentrl-weights-"))
        self._num_files = 0

    async def send(self, bucket: Bucket, version: int | None) -> None:
        from safetensors.torch import save_file

        assert self._dir is not None, "DiskSender.send before begin()"
        t0 = time.perf_counter()
        tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
        path = self._dir / f"model-{self._num_files:05d}.safetensors"
        await asyncio.to_thread(save_file, tensors, str(path))
        self._num_files += 1
        self.phases["send_s"] += time.perf_counter() - t0

    async def end(self, version: int) -> None:
        assert self._dir is not None, "DiskSender.end before begin()"
        t0 = time.perf_counter()
        try:
            for name in _MODEL_FILES:
                if (Path(self.model_path) / name).is_file():
                    shutil.copyfile(Path(self.model_path) / name, self._dir / name)
            path = str(self._dir)
            await asyncio.gather(
                *(t.update_weights_from_disk(path, weight_version=version) for t in self.targets)
            )
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.phases["end_s"] = time.perf_counter() - t0

    async def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
