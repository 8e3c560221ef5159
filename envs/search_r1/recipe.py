"""The `search_r1` recipe, found by `agentrl.config.recipe_for_env` through the
`agentrl.recipes` entry-point group."""

from __future__ import annotations

from agentrl_envs.search_r1.env import BRIEF_PROMPT_TEMPLATE, SEARCH_FIRST_HINT

from agentrl.config import RunConfig


def recipe() -> RunConfig:
    """Search-R1 (paper: lr 1e-6, group 5, KL 0.001, temperature 1.0) scaled to the embedded
    SmolLM2-135M on a 2-core CPU, so the first command learns to search and answer in under
    30 minutes.

    Reward `f1_format`: 0.9 x token F1 of the last `<answer>` against the gold answers (SQuAD
    normalisation) + 0.1 for an `<answer>` given after a search; EM is reported on its own (pass
    rate). Search-R1's `qa_em_format` paid 0.2 for any well-formed answer and 1 only for an
    exact one: this model states the right title about half the time wrapped in a sentence
    (EM 0), so every group tied at 0.2 once the format was learned, and the policy stopped
    searching. F1 pays part of the way for a wrapped answer, so trimming it pays.

    Observations: BM25's top-1 document only (its title is the gold answer for 95% of the
    embedded test questions searched as written; the model read the answer from one passage
    56% of the time and from three 24%). The prompt asks for a search, then a brief answer,
    and the demonstration shows exactly that episode: search with the question, answer with
    Doc 1's title (no <think>: with it the model ended its turn after thinking, unsearched).
    A turn that opens `<search>` but closes it with `</answer>` (or not at all) still searches
    (`lenient_search`: 113 of the 139 greedy first turns that opened a search on one H100), and
    a turn with neither action gets a hint that says to search first. No KL term: no
    reference model to hold or run. Up to 2 searches then the answer turn, 64 tokens a turn.
    """
    cfg = RunConfig()
    cfg.env.id = "search_r1"
    cfg.env.kwargs = {
        "reward": "f1_format",
        "demonstration": True,
        "topk": 1,
        "max_turns": 2,
        "max_observation_tokens": 192,
        "prompt_template": BRIEF_PROMPT_TEMPLATE,
        "invalid_action_hint": SEARCH_FIRST_HINT,
        "lenient_search": True,
    }
    cfg.rollout.rollout_batch_size = 4
    cfg.rollout.n_samples_per_prompt = 5
    cfg.rollout.rollout_max_response_len = 64
    cfg.rollout.rollout_max_context_len = 1536
    cfg.rollout.rollout_temperature = 0.7
    cfg.rollout.max_turns = 3
    cfg.rollout.max_observation_tokens = 256
    cfg.train.num_rollout = 6
    cfg.train.lr = 2e-5
    # Memory (peak RSS 19.5 GB with 4096-token rows, 10.8 GB with 1024): on CPU a packed row's
    # block-diagonal mask sends SDPA down its math path, which keeps [heads, T, T] scores per
    # layer for backward. An episode here is longer than 512 tokens, so each sits alone in its
    # row: no mask, SDPA's memory-efficient causal kernel, no attention across episodes.
    cfg.train.max_tokens_per_micro_batch = 512
    # The engine keeps 2 x max_batch_size KV slots, and every slot it has written stays
    # resident: 20 = one step's episodes (eval runs its 64 in waves).
    cfg.engine.max_batch_size = 20
    cfg.checkpoint.save = "runs/search_r1"
    cfg.eval.num_eval_tasks = 64
    return cfg
