"""The LoRA half of the stand-in for SGLang's tokenizer manager and scheduler: adapters loaded from
tensors and unloaded, answered as SGLang answers (0.5.23: managers/tokenizer_control_mixin.py,
managers/tp_worker.py, lora/lora_manager.py, lora/lora_registry.py).

What runs is SGLang's own code where it is not the GPU: its request class (the route's body),
`normalize_serialized_named_tensor_payloads` (0.5.23), `MultiprocessingSerializer`'s safe
unpickler, `FlattenedTensorBucket`, `LoRAConfig.from_dict` and `LoRAAdapter`'s weight loading
(PEFT names -> its fused qkv_proj / gate_up_proj stacks, on the CPU). The memory pool and the
kernels are the GPU's; the loaded adapters are kept here for tests to look at."""

from __future__ import annotations

from typing import Any

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraStandIn:
    """Mixed into `StandInTokenizerManager` after the weight half (its `_deserialize`)."""

    def _init_lora(self) -> None:
        self.loras: dict[str, Any] = {}  # lora_name -> SGLang's LoRAAdapter
        self.lora_paths_seen: list[str | None] = []  # each /generate's lora_path

    def _lora_result(self, error: str | None = None) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        loaded = {name: "__tensor__" for name in self.loras}
        return LoRAUpdateOutput(success=error is None, error_message=error, loaded_adapters=loaded)

    async def load_lora_adapter_from_tensors(self, obj: Any, request: Any = None) -> Any:
        if not self.server_args.enable_lora:
            return self._lora_result(NOT_ENABLED)
        if obj.lora_name in self.loras:  # LoRAManager.validate_new_adapter
            return self._lora_result(
                f"Failed to load LoRA adapter {obj.lora_name} because it is already loaded"
            )
        try:
            tensors: dict[str, Any] = {}
            for payload in self._own_payloads(obj):
                tensors = self._reconstruct(self._deserialize(payload), obj.load_format)
            self.loras[obj.lora_name] = self._adapter(obj, tensors)
        except Exception as e:  # the scheduler reports these as a failed update
            return self._lora_result(f"{type(e).__name__}: {e}")
        return self._lora_result()

    def _own_payloads(self, obj: Any) -> list[Any]:
        """What each TP rank deserializes: 0.5.23, its own of one copy per rank; 0.5.15, the one
        `serialized_tensors` every rank opens."""
        if not hasattr(obj, "serialized_named_tensors"):
            return [obj.serialized_tensors] * self.tp_size
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        payloads = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        if len(payloads) < self.tp_size:
            raise IndexError(f"{self.tp_size} TP ranks, {len(payloads)} payloads sent")
        return payloads[: self.tp_size]

    def _adapter(self, obj: Any, tensors: dict[str, Any]) -> Any:
        from sglang.srt.lora.lora import LoRAAdapter
        from sglang.srt.lora.lora_config import LoRAConfig
        from transformers import AutoConfig

        base = AutoConfig.from_pretrained(self.model_path)
        try:
            config = LoRAConfig.from_dict(obj.config_dict, None, base_vocab_size=base.vocab_size)
        except TypeError:  # 0.5.15: no base_vocab_size
            config = LoRAConfig.from_dict(obj.config_dict, None)
        adapter = LoRAAdapter(obj.lora_name, config, base, None, None)  # type: ignore[arg-type]
        adapter.initialize_weights_from_tensors(tensors)
        return adapter

    async def unload_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        if not self.server_args.enable_lora:
            return self._lora_result(NOT_ENABLED)
        if self.loras.pop(obj.lora_name, None) is None:  # LoRARegistry.unregister
            return self._lora_result(
                f"LoRA with name {obj.lora_name} does not exist. Loaded LoRAs: {list(self.loras)}"
            )
        return self._lora_result()

    def check_lora_path(self, lora_path: Any) -> None:
        """LoRARegistry.acquire: a request naming an adapter that is not loaded fails."""
        self.lora_paths_seen.append(lora_path)
        if lora_path is not None and lora_path not in self.loras:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {lora_path}")

    def lora_state(self) -> dict[str, Any]:
        return {
            "loras": {
                name: {
                    "scaling": adapter.scaling,
                    "weights": {
                        n: t.flatten().tolist()
                        for layer in adapter.layers
                        for n, t in layer.weights.items()
                    },
                    "shapes": {
                        n: list(t.shape)
                        for layer in adapter.layers
                        for n, t in layer.weights.items()
                    },
                }
                for name, adapter in self.loras.items()
            },
            "lora_paths_seen": self.lora_paths_seen,
        }
