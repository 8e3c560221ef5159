"""A corpus BM25 cannot index is refused in one line naming the file (issue 38: a row whose
`contents` is no string gave a 66-line traceback from the tokenizer; a corpus of stop words
alone gave bm25s's `max() arg is an empty sequence`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"id": "1", "contents": "fine"}\n{"id": "2", "contents": 123}\n',
         "line 2: 'contents' is 123 (a int), not text"),
        ('{"id": "1", "contents": ["a", "list"]}\n', "line 1: 'contents' is ['a', 'list']"),
        ('{"id": "1", "contents": null}\n', "line 1: 'contents' is None"),
        ('{"id": "1", "contents": "the a of"}\n{"id": "2", "contents": "and is it!"}\n',
         "its 2 document(s) hold no word BM25 can index"),
    ],
)  # fmt: skip
def test_a_corpus_bm25_cannot_index_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, named: str
) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(text)
    result = runner.invoke(app, ["retriever", "serve", "--corpus", str(corpus)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error: ")
    assert str(corpus) in line and named in line
