"""Imported by each module of this package that imports `megatron.core`, just before it does (the
one patch that cannot wait for `patches.install_all`: it is needed for the import itself).

megatron-core (0.19) sets `torch_memory_saver.hook_mode = "torch"` at import, and the saver's
setter fails (AttributeError) once the saver is initialised -- which a colocated engine in the
same process has done when the trainer is built after it (`agentrl train --train-backend
megatron` on one GPU). The engine sets the same mode (`engine.local.device_memory`), so the
setter is given a throwaway slot for the duration of the import: nothing changes but that the
import works."""

from __future__ import annotations

import sys

was_needed = False
"""Whether megatron.core was imported past an initialised saver (`patches.install_all` logs it)."""


def _import_megatron_core_past_an_initialised_saver() -> None:
    global was_needed
    saver = getattr(sys.modules.get("torch_memory_saver"), "torch_memory_saver", None)
    if saver is None or "megatron.core" in sys.modules or hasattr(saver, "_impl_ctor_kwargs"):
        return  # no saver, megatron already imported, or the saver still takes settings
    saver._impl_ctor_kwargs = {}
    try:
        import megatron.core.inference.contexts  # noqa: F401  (the module that sets the mode)
    finally:
        del saver._impl_ctor_kwargs
    was_needed = True


_import_megatron_core_past_an_initialised_saver()
