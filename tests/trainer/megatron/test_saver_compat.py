"""Importing the Megatron backend after a colocated engine initialised `torch_memory_saver` (the
one-GPU `--train-backend megatron` run): megatron-core sets the saver's hook mode at import, which
the initialised saver refuses. The saver here stands in with the real one's setter contract
(torch_memory_saver 0.0.10 `entrypoint.py`), since the real one needs CUDA to initialise."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

# Not imported here: this process may hold an initialised saver (a GPU run of the suite).
if (
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None
):
    pytest.skip("megatron-core is not installed", allow_module_level=True)

STAND_IN = textwrap.dedent(
    """
    import sys, types

    class TorchMemorySaver:  # the setter contract of torch_memory_saver.entrypoint
        def __init__(self):
            self._impl_ctor_kwargs = {}

        @property
        def hook_mode(self):
            raise AttributeError

        @hook_mode.setter
        def hook_mode(self, mode):
            assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
            self._impl_ctor_kwargs["hook_mode"] = mode

        def initialise(self):  # what its _ensure_initialized does
            self.impl = dict(self._impl_ctor_kwargs)
            del self._impl_ctor_kwargs

    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = TorchMemorySaver()
    sys.modules["torch_memory_saver"] = module
    saver = module.torch_memory_saver
    saver.hook_mode = "torch"  # as engine.local.device_memory does
    saver.initialise()
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAND_IN + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_plain_megatron_import_fails_after_the_saver_is_initialised():
    # What the guard is for: without it, importing megatron.core raises here.
    result = _run("import megatron.core.inference.contexts")
    assert result.returncode != 0
    assert "_impl_ctor_kwargs" in result.stderr


def test_backend_imports_after_an_initialised_saver_and_leaves_it_as_it_was():
    result = _run(
        """
        import agentrl.trainer.megatron.backend
        import megatron.core
        assert not hasattr(saver, "_impl_ctor_kwargs"), "the saver must stay initialised"
        assert saver.impl == {"hook_mode": "torch"}
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
