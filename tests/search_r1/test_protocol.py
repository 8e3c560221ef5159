"""The Search-R1 text protocol, compared with the original's strings."""

from __future__ import annotations

from agentrl_envs.search_r1.protocol import (
    INVALID_ACTION_HINT,
    cut_at_stop,
    format_documents,
    format_observation,
    make_prompt,
    parse_action,
)

# Search-R1 scripts/data_process/nq_search.py, make_prefix(template_type="base"), verbatim.
SEARCH_R1_PREFIX = f"""Answer the given question. \
You must conduct reasoning inside <think> and </think> first every time you get new information. \
After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. \
You can search as many times as your want. \
If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {"who wrote hamlet?"}\n"""

# Search-R1 search_r1/llm_agent/generation.py, execute_predictions, the invalid branch.
SEARCH_R1_HINT = "\nMy previous action is invalid. \
If I want to search, I should put the query between <search> and </search>. \
If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"


def test_prompt_equals_search_r1_verbatim() -> None:
    assert make_prompt("who wrote hamlet?") == SEARCH_R1_PREFIX
    assert "as your want" in SEARCH_R1_PREFIX  # the original's typo is kept


def test_question_is_stripped_and_gets_a_question_mark_like_nq_search() -> None:
    assert make_prompt("  who wrote hamlet ") == SEARCH_R1_PREFIX


def test_invalid_action_hint_equals_search_r1_verbatim() -> None:
    assert INVALID_ACTION_HINT == SEARCH_R1_HINT


def test_observation_format_matches_passages2string() -> None:
    docs = ['"Paris"\nParis is the capital of France.', '"Seine"\nThe Seine flows\nthrough Paris.']
    text = format_observation(format_documents(docs))
    assert text == (
        '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
        'Doc 2(Title: "Seine") The Seine flows\nthrough Paris.</information>\n\n'
    )


def test_parse_action_takes_the_first_block_after_cutting_at_the_first_stop() -> None:
    assert parse_action("<think>x</think><search> a b </search>").kind == "search"
    assert parse_action("<think>x</think><search> a b </search>").content == "a b"
    assert parse_action("<answer> Paris </answer>").content == "Paris"
    # an engine that overran the stop string: everything after </search> is ignored
    overrun = "<search>q1</search><answer>x</answer>"
    assert cut_at_stop(overrun) == "<search>q1</search>"
    assert parse_action(overrun).kind == "search"


def test_parse_action_without_a_closed_block_is_invalid() -> None:
    assert parse_action("I think the answer is Paris").kind is None
    assert parse_action("<search>never closed").kind is None
    assert parse_action("<answer>never closed").kind is None
