"""`agentrl retriever serve | build-corpus` refuse bad flags and corpora in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "99999"], "'--port'"),
        (["--port", "0"], "'--port'"),
        (["--topk", "0"], "'--topk'"),
    ],
)
def test_an_out_of_range_serve_flag_is_a_usage_error(
    corpus_path: Path, flags: list[str], named: str
) -> None:
    args = ["retriever", "serve", "--corpus", str(corpus_path), *flags]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output, prefix="error: ")  # not typer's boxed usage block


def test_a_missing_corpus_is_one_error_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["retriever", "serve", "--corpus", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error: ")
    assert line.endswith("nope.jsonl: no such file; give a JSONL corpus or 'embedded'")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("not json\n", "line 1: expected a JSON object with 'id' and 'contents'"),
        ('{"id": "1"}\n', "line 1: expected a JSON object with 'id' and 'contents'"),
        ('{"contents": "x"}\n', "line 1: expected a JSON object with 'id' and 'contents'"),
        ("", "has no documents"),
        # a row whose contents is no string (a 66-line tokenizer traceback before), a corpus
        # of stop words alone (bm25s's `max() arg is an empty sequence` before)
        (
            '{"id": "1", "contents": "fine"}\n{"id": "2", "contents": 123}\n',
            "line 2: 'contents' is 123 (a int), not text",
        ),
        ('{"id": "1", "contents": ["a", "list"]}\n', "line 1: 'contents' is ['a', 'list']"),
        ('{"id": "1", "contents": null}\n', "line 1: 'contents' is None"),
        (
            '{"id": "1", "contents": "the a of"}\n{"id": "2", "contents": "and is it!"}\n',
            "its 2 document(s) hold no word BM25 can index",
        ),
    ],
)
def test_a_bad_corpus_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, named: str
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(text)
    result = runner.invoke(app, ["retriever", "serve", "--corpus", str(corpus)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error: ")
    assert str(corpus) in line and named in line


def test_a_corpus_that_is_not_utf8_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b"\xff\xfe")
    result = runner.invoke(app, ["retriever", "serve", "--corpus", str(corpus)])
    assert result.exit_code == 2, result.output
    assert f"--corpus {corpus} is not UTF-8" in one_line(result.output, prefix="error: ")


@pytest.mark.parametrize(
    ("out", "named"),
    [
        (".", "is a directory; give a file path"),
        ("afile/x.jsonl", "is not an existing directory"),
        ("missing/x.jsonl", "is not an existing directory"),
    ],
)
def test_build_corpus_refuses_an_out_that_cannot_be_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, named: str
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "afile").write_text("")
    target = tmp_path / out
    result = runner.invoke(app, ["retriever", "build-corpus", "--out", str(target)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error: ")
    assert f"--out {target}" in line and named in line
    assert not (tmp_path / "cache").exists()  # refused before the corpus is built


@pytest.mark.parametrize(
    ("host", "given", "is_made"),
    [("0.0.0.0", None, True), ("0.0.0.0", "k1", False), ("127.0.0.1", None, False)],
)
def test_serve_off_the_loopback_without_a_key_makes_one(
    corpus_path: Path, monkeypatch, host: str, given: str | None, is_made: bool
) -> None:
    """Secure by default, as `agentrl serve` and `env serve`: a retriever bound beyond loopback
    without a key serves with one made for the run, announced with the variable clients read."""
    served: dict = {}

    class Server:
        def run(self) -> None:
            served["ran"] = True

    def make_server(path, **kwargs):
        served.update(kwargs)
        return Server()

    monkeypatch.setattr("agentrl_envs.search_r1.server.make_server", make_server)
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    args = ["retriever", "serve", "--corpus", str(corpus_path), "--host", host]
    args += ["--api-key", given] if given else []
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert served["ran"]
    if is_made:
        key = served["api_key"]
        assert key and len(key) >= 32 and f"AGENTRL_API_KEY={key}" in result.output
    else:
        assert served["api_key"] == given and "AGENTRL_API_KEY=" not in result.output
