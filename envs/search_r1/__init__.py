"""search_r1: retrieval-augmented QA after Search-R1 (arXiv 2503.09516), runnable offline.

Only `SPEC` lives here, so env discovery never imports bm25s, httpx or the corpus.
"""

from __future__ import annotations

from agentrl.envs import EnvSpec

SPEC = EnvSpec(
    id="search_r1",
    entry_point="agentrl_envs.search_r1.env:SearchR1Env",
    description=(
        "Search-R1 QA: <search> a Wikipedia-summary corpus (BM25, embedded) or a Search-R1 "
        "retrieval server, then <answer>; reward EM, F1, format, or F1 with a format term (the recipe)"
    ),
)

__all__ = ["SPEC"]
