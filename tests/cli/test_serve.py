"""`agentrl serve` refuses bad values before it binds anything, in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "/does/not/exist"], "model path '/does/not/exist' is neither"),
        (["--device", "tpu"], "device='tpu' is not a torch device; use auto, cpu, cuda"),
    ],
)
def test_a_bad_value_is_one_error_line(flags, named):
    result = runner.invoke(app, ["serve", *flags])
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output, prefix="error: ")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "99999"], "'--port'"),
        (["--max-batch-size", "0"], "'--max-batch-size'"),
        (["--reserve-gb", "-1"], "'--reserve-gb'"),
    ],
)
def test_an_out_of_range_flag_is_a_usage_error(flags, named):
    result = runner.invoke(app, ["serve", *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """These values must be refused before the weights load: loading fails the test."""
    from agentrl.engine.local import LocalEngine

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(LocalEngine, "load", load)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--mem-fraction-static", "-3"], "--mem-fraction-static=-3 must be in (0, 1]"),
        (["--mem-fraction-static", "0"], "--mem-fraction-static=0 must be in (0, 1]"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static=1.5 must be in (0, 1]"),
        (["--mem-fraction-static", "nan"], "--mem-fraction-static=nan must be in (0, 1]"),
        (["--reserve-gb", "inf"], "--reserve-gb=inf must be a finite number"),
    ],
)
def test_a_bad_value_is_refused_before_loading(no_model_load, flags, named):
    result = runner.invoke(app, ["serve", *flags])
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output, prefix="error: ")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_refused_before_loading(no_model_load, monkeypatch, device):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["serve", "--device", device])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        f"error: --device {device} but torch sees no CUDA GPU here; use --device cpu or auto"
    ]


def test_a_cuda_ordinal_past_the_gpus_is_refused_before_loading(no_model_load, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = runner.invoke(app, ["serve", "--device", "cuda:2"])
    assert result.exit_code == 2, result.output
    assert "error: --device cuda:2 but torch sees 2 CUDA GPU(s)" in result.output


def test_an_unknown_log_level_is_a_usage_error(no_model_load):
    result = runner.invoke(app, ["serve", "--log-level", "bogus"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "'--log-level'" in result.output and "'bogus' is not one of" in result.output
    assert "'trace'" in result.output and "Traceback" not in result.output


def test_dtype_help_lists_every_accepted_name():
    from agentrl.model_store import resolve_dtype

    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    help_text = " ".join(result.output.split())  # the help wraps at 80 columns
    for name, alias in (("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")):
        assert resolve_dtype(name) == resolve_dtype(alias)  # accepted ...
        assert f"{name} ({alias})" in help_text  # ... and documented


@pytest.mark.parametrize(
    ("flags", "made"),
    [
        (["--host", "0.0.0.0"], True),
        (["--host", "0.0.0.0", "--api-key", "k"], False),
        (["--host", "::1"], False),
        (["--host", "127.0.0.2"], False),
    ],
)
def test_binding_beyond_loopback_without_a_key_makes_one(monkeypatch, flags, made):
    """Secure by default (issue 38): off the loopback without --api-key, `agentrl serve` makes a
    key for the run, serves with it, and says where clients read it from; before the model loads."""
    from agentrl.engine.local import LocalEngine

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("stopped before loading")

    monkeypatch.setattr(LocalEngine, "load", load)
    result = runner.invoke(app, ["serve", *flags], env={"AGENTRL_API_KEY": "", "COLUMNS": "300"})
    assert result.exit_code == 2 and "error: stopped before loading" in result.output
    notice = "binding 0.0.0.0 without --api-key: a key made for this run guards who can generate"
    assert (notice in result.output) is made, result.output
    assert ("AGENTRL_API_KEY=" in result.output) is made


def test_the_made_key_is_the_one_the_server_wants(monkeypatch):
    import re

    from agentrl.engine.local import LocalEngine
    from agentrl.engine.serve import app as serve_app

    served: dict = {}
    engine = type("E", (), {"model_path": "m", "device": "cpu", "tokenizer": None})()
    monkeypatch.setattr(LocalEngine, "load", lambda *a, **k: engine)
    monkeypatch.setattr(
        "agentrl.rollout.codec.ChatCodec", lambda tokenizer: type("C", (), {"parse": None})()
    )
    monkeypatch.setattr(serve_app, "serve", lambda engine, **kw: served.update(kw))
    result = runner.invoke(
        app, ["serve", "--host", "0.0.0.0"], env={"AGENTRL_API_KEY": "", "COLUMNS": "300"}
    )
    assert result.exit_code == 0, result.output
    (key,) = re.findall(r"AGENTRL_API_KEY=(\S+)", result.output)
    assert served["api_key"] == key and len(key) >= 32
