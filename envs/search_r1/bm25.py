"""BM25 over a Search-R1-format corpus with `bm25s`; the index is built once per corpus
(keyed by the file's hash) and cached on disk."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from agentrl_envs.search_r1.retrieval import Document, QueryBatcher
from rich.progress import Progress

INDEX_FORMAT = "bm25s-v1"  # bump when the tokenisation or the saved layout changes
_CHUNK_DOCS = 2_000


def cache_root() -> Path:
    """`$AGENTRL_CACHE/search_r1`, default `~/.cache/agentrl/search_r1`."""
    return Path(os.environ.get("AGENTRL_CACHE", "~/.cache/agentrl")).expanduser() / "search_r1"


def read_corpus(path: str | Path) -> list[Document]:
    """Read `{"id", "contents"}` JSONL rows; a bad row raises naming its line and the fix."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                docs.append(Document(id=str(row["id"]), contents=row["contents"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"corpus {path} line {line_no}: expected a JSON object with 'id' and 'contents' "
                    f'("\\"Title\\"\\ntext"), got {line[:80]!r} ({e})'
                ) from None
            if not isinstance(docs[-1].contents, str):  # the tokenizer would fail far from here
                raise ValueError(
                    f"corpus {path} line {line_no}: 'contents' is {row['contents']!r:.40} (a "
                    f"{type(row['contents']).__name__}), not text; write it as a JSON string "
                    '("\\"Title\\"\\ntext")'
                )
    if not docs:
        raise ValueError(
            f"corpus {path} has no documents; expected JSONL rows with 'id' and 'contents'"
        )
    return docs


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stemmer():
    try:
        import Stemmer  # PyStemmer: better recall; bm25s works without it
    except ImportError:
        return None
    return Stemmer.Stemmer("english")


class BM25Index:
    """A loaded bm25s index and the documents it points into (synchronous, thread-safe reads)."""

    def __init__(self, model, documents: list[Document]) -> None:
        self.model = model
        self.documents = documents
        self._stemmer = _stemmer()

    @classmethod
    def load_or_build(
        cls, corpus: str | Path, *, cache_dir: str | Path | None = None, show_progress: bool = True
    ) -> BM25Index:
        bm25s = _bm25s()

        documents = read_corpus(corpus)
        key = f"{INDEX_FORMAT}-{'stem' if _stemmer() else 'nostem'}-{file_sha256(corpus)[:20]}"
        index_dir = Path(cache_dir) if cache_dir else cache_root() / "bm25" / key
        if (index_dir / "params.index.json").exists():
            return cls(bm25s.BM25.load(str(index_dir), show_progress=False), documents)
        model = _build(documents, show_progress=show_progress, corpus=corpus)
        _save_atomically(model, index_dir)
        return cls(model, documents)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Document]]:
        bm25s = _bm25s()

        if not queries:
            return []
        topk = min(topk, len(self.documents))
        tokens = bm25s.tokenize(
            list(queries),
            stopwords="en",
            stemmer=self._stemmer,
            return_ids=False,
            show_progress=False,
        )
        ids, scores = self.model.retrieve(tokens, k=topk, show_progress=False, n_threads=1)
        return [
            [
                _scored(self.documents[int(i)], float(s))
                for i, s in zip(row_ids, row_scores, strict=True)
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


def _bm25s():
    """`bm25s`, imported with JAX (when installed) kept on the CPU: bm25s imports jax and runs a
    top-k at import, and JAX on a GPU then pre-allocates 75% of its memory (on one H100 that left
    the colocated engine and trainer out of memory). Retrieval needs no GPU."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def _scored(doc: Document, score: float) -> Document:
    return Document(id=doc.id, contents=doc.contents, score=score)


def _build(documents: list[Document], *, show_progress: bool, corpus: str | Path = ""):
    bm25s = _bm25s()

    stemmer = _stemmer()
    tokens: list[list[str]] = []
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task("BM25: tokenizing corpus", total=len(documents))
        for start in range(0, len(documents), _CHUNK_DOCS):
            chunk = [d.contents for d in documents[start : start + _CHUNK_DOCS]]
            tokens += bm25s.tokenize(
                chunk, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False
            )
            progress.advance(task, len(chunk))
        if not any(tokens):  # bm25s fails on an empty vocabulary with `max() arg is an empty ...`
            raise ValueError(
                f"corpus {corpus}: its {len(documents)} document(s) hold no word BM25 can index "
                "(only English stop words or punctuation); add documents with content words"
            )
        progress.add_task("BM25: indexing", total=None)
        model = bm25s.BM25()
        model.index(tokens, show_progress=False)
    return model


def _save_atomically(model, index_dir: Path) -> None:
    """Write into a temp dir and rename, so a concurrent reader never sees half an index."""
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=index_dir.parent, prefix=".tmp-"))
    try:
        model.save(str(tmp), show_progress=False)
        os.replace(tmp, index_dir)
    except OSError:
        if not (index_dir / "params.index.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_INDEXES: dict[tuple[str, str], BM25Index] = {}
_INDEXES_LOCK = threading.Lock()


def shared_index(corpus: str | Path, *, cache_dir: str | Path | None = None) -> BM25Index:
    """One loaded index per corpus file per process, however many envs use it."""
    key = (str(Path(corpus).resolve()), str(cache_dir))
    with _INDEXES_LOCK:
        if key not in _INDEXES:
            _INDEXES[key] = BM25Index.load_or_build(corpus, cache_dir=cache_dir)
        return _INDEXES[key]


class BM25Retriever:
    """The in-process `Retriever`: concurrent searches are batched into one bm25s call,
    run in a worker thread so the event loop keeps serving other episodes."""

    def __init__(
        self, corpus: str | Path, *, cache_dir: str | Path | None = None, window_s: float = 0.002
    ) -> None:
        self.corpus = str(corpus)
        self.cache_dir = cache_dir
        self.batcher = QueryBatcher(self._search_batch, window_s=window_s)

    @property
    def index(self) -> BM25Index:
        return shared_index(self.corpus, cache_dir=self.cache_dir)

    async def _search_batch(self, queries: list[str], topk: int) -> list[list[Document]]:
        return await asyncio.to_thread(self.index.search, queries, topk)

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Document]]:
        return await self.batcher.search(queries, topk)

    async def close(self) -> None:
        return None
