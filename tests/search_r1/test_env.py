"""SearchR1Env episodes over a small BM25 corpus: search, hint, answer, final turn, caps."""

from __future__ import annotations

from pathlib import Path

import pytest
from agentrl_envs.search_r1.env import (
    DEMONSTRATION_ANSWER,
    DEMONSTRATION_DOCUMENTS,
    DEMONSTRATION_QUESTION,
    SEARCH_FIRST_HINT,
    SearchR1Env,
    demonstration_turns,
)
from agentrl_envs.search_r1.protocol import INVALID_ACTION_HINT, make_prompt

from agentrl.envs import make
from agentrl.types import Message, StatusReason, Task, ToolCall

TASK = Task(
    id="t0", data={"question": "what is the capital of France", "golden_answers": ["Paris"]}
)


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


async def started(corpus_path: Path, **kwargs) -> SearchR1Env:
    env = SearchR1Env(corpus=str(corpus_path), **kwargs)
    messages, _ = await env.reset(options={"task": TASK})
    assert [m.role for m in messages] == ["user"]
    template = kwargs.get("prompt_template")
    assert messages[0].content == make_prompt(
        "what is the capital of France", *filter(None, [template])
    )
    return env


def test_registered_with_search_r1_protocol() -> None:
    env = make("search_r1")
    assert isinstance(env, SearchR1Env)
    assert env.tool_call_format == "tags"
    assert env.stop == ("</search>", "</answer>")
    (schema,) = env.tools.schemas()
    assert schema["function"]["name"] == "search"
    assert list(schema["function"]["parameters"]["properties"]) == ["query"]


async def test_search_returns_information_block(corpus_path: Path) -> None:
    env = await started(corpus_path)
    result = await env.step(say("<think>need it</think>\n<search> capital of France </search>"))
    assert not result.terminated and not result.truncated and result.reward == 0.0
    (obs,) = result.observation
    assert obs.role == "tool" and obs.name == "search"
    assert obs.content.startswith('\n\n<information>Doc 1(Title: "Paris") Paris is the capital')
    assert obs.content.endswith("</information>\n\n")
    assert obs.content.count("Doc ") == 3  # topk=3
    assert result.info["num_tool_calls"] == 1 and result.info["num_tool_errors"] == 0
    assert result.info["query"] == "capital of France"


async def test_answer_terminates_with_em_and_components(corpus_path: Path) -> None:
    env = await started(corpus_path)
    await env.step(say("<think>a</think>\n<search> France capital </search>"))
    result = await env.step(say("<think>b</think>\n<answer> the paris </answer>"))
    assert result.terminated and not result.truncated
    assert result.reward == 1.0
    assert result.info["answer"] == "the paris"
    parts = result.info["reward_components"]
    assert parts["em"] == 1.0 and parts["f1"] == 1.0 and parts["is_valid_format"] is True
    assert result.info["num_searches"] == 1 and result.info["num_turns"] == 2


@pytest.mark.parametrize(("reward", "expected"), [("em", 0.0), ("f1", 2 / 3), ("format", 0.1)])
async def test_reward_options(corpus_path: Path, reward: str, expected: float) -> None:
    env = await started(corpus_path, reward=reward)
    result = await env.step(say("<answer> Paris France </answer>"))
    assert result.reward == pytest.approx(expected)


async def test_recipe_leads_with_exact_match_and_counts_searches(corpus_path: Path) -> None:
    from agentrl.config import recipe_for_env

    kwargs = {**recipe_for_env("search_r1").env.kwargs, "demonstration": False}
    assert kwargs["reward"] == "em_f1_format"
    env = await started(corpus_path, **kwargs)
    searched = await env.step(say("<search> capital of France </search>"))
    assert 1 <= searched.observation[0].content.count("Doc ") <= kwargs["topk"]
    exact = await env.step(say("<answer> Paris </answer>"))
    assert exact.reward == pytest.approx(1.0) and exact.info["correct"] is True
    env = await started(corpus_path, **kwargs)
    await env.step(say("<search> capital of France </search>"))
    wrapped = await env.step(say("<answer> it is Paris </answer>"))  # F1 1/2: 0.9 * 0.25 + 0.1
    assert wrapped.reward == pytest.approx(0.325)
    parts = wrapped.info["reward_components"]
    assert parts["em"] == 0.0 and parts["f1"] == pytest.approx(0.5)
    assert parts["searches"] == 1 and parts["searched"] is True
    assert wrapped.info["correct"] is False
    env = await started(corpus_path, **kwargs)
    unsearched = await env.step(say("<answer> Paris </answer>"))  # right without a search
    assert unsearched.reward == pytest.approx(0.9)
    assert wrapped.reward < unsearched.reward < exact.reward
    env = await started(corpus_path, **kwargs)
    wrong = await env.step(say("<answer> Lyon </answer>"))  # a guess, no search: nothing
    assert wrong.reward == 0.0
    assert wrong.info["reward_components"]["searched"] is False
    env = await started(corpus_path, **kwargs)
    lost = await env.step(say("The answer is Paris."))  # no action: the recipe's hint
    assert lost.observation[0].content == SEARCH_FIRST_HINT
    assert "<search>" in SEARCH_FIRST_HINT and "<answer>" in SEARCH_FIRST_HINT
    env = await started(corpus_path, **kwargs)
    for _ in range(env.max_turns + 1):  # never answers: truncated, nothing paid
        last = await env.step(say("hmm"))
    assert last.truncated and last.reward == 0.0
    assert last.info["reward_components"]["is_answered"] is False


def test_recipe_never_asks_for_a_title() -> None:
    """The recipe's prompt, hint and worked episode ask for the answer read from the
    documents: the title prompt taught a 135M policy to copy Doc 1's title for every question."""
    from agentrl.config import recipe_for_env

    kwargs = recipe_for_env("search_r1").env.kwargs
    turns = demonstration_turns(3)
    texts = [kwargs["prompt_template"], kwargs["invalid_action_hint"], DEMONSTRATION_QUESTION]
    texts += [text for role, text in turns if role == "assistant"]
    assert not [t for t in texts if "title" in t.lower()]
    assert "answer" in kwargs["prompt_template"] and "documents" in kwargs["prompt_template"]
    answer = turns[-1][1]
    assert answer == f"<answer> {DEMONSTRATION_ANSWER} </answer>"
    first_doc = DEMONSTRATION_DOCUMENTS[0]
    title, text = first_doc.split("\n", 1)
    assert DEMONSTRATION_ANSWER in text and DEMONSTRATION_ANSWER not in title


def test_format_weight_is_checked() -> None:
    with pytest.raises(ValueError, match=r"format_weight=0.7: use 0 <= format_weight < 0.5"):
        SearchR1Env(format_weight=0.7)


async def test_demonstration_is_one_worked_episode_before_the_question(
    corpus_path: Path,
) -> None:
    env = SearchR1Env(corpus=str(corpus_path), demonstration=True)
    messages, _ = await env.reset(options={"task": TASK})
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[-1].content == make_prompt("what is the capital of France")
    # it searches with the question as written and answers from Doc 1's text, briefly
    assert messages[1].content == f"<search> {DEMONSTRATION_QUESTION} </search>"
    assert messages[2].content.startswith('\n\n<information>Doc 1(Title: "Paris")')
    assert "Doc 3" in messages[2].content  # as many documents as the env's topk (3)
    assert messages[3].content == f"<answer> {DEMONSTRATION_ANSWER} </answer>"
    one = SearchR1Env(corpus=str(corpus_path), demonstration=True, topk=1)
    shown, _ = await one.reset(options={"task": TASK})
    assert "Doc 2" not in shown[2].content
    # only the episode's own turns are scored: an answer-less episode still gets nothing
    for _ in range(env.max_turns + 1):
        last = await env.step(say("hmm"))
    assert last.info["reward_components"]["is_answered"] is False


async def test_invalid_action_gets_the_hint_and_goes_on(corpus_path: Path) -> None:
    env = await started(corpus_path)
    result = await env.step(say("I am not sure what to do."))
    assert [m.content for m in result.observation] == [INVALID_ACTION_HINT]
    assert not result.terminated and not result.truncated and result.reward == 0.0
    assert result.info["num_tool_calls"] == 0


async def test_max_turns_then_one_final_turn_without_search(corpus_path: Path) -> None:
    env = await started(corpus_path, max_turns=2)
    for _ in range(2):
        result = await env.step(say("<search> Paris </search>"))
        assert not result.terminated and not result.truncated
    final = await env.step(say("<search> still searching </search>"))
    assert final.truncated and not final.terminated
    assert final.info["truncated_reason"] == StatusReason.MAX_TURNS.value
    assert (
        final.observation == [] and final.info["num_tool_calls"] == 0
    )  # no search on the final turn
    assert final.reward == 0.0 and final.info["num_searches"] == 2


async def test_answer_on_the_final_turn_is_scored(corpus_path: Path) -> None:
    env = await started(corpus_path, max_turns=1)
    await env.step(say("<search> Paris </search>"))
    result = await env.step(say("<answer>Paris</answer>"))
    assert result.terminated and result.reward == 1.0


async def test_without_final_turn_max_turns_is_the_last(corpus_path: Path) -> None:
    env = await started(corpus_path, max_turns=1, use_final_answer_turn=False)
    result = await env.step(say("<search> Paris </search>"))
    assert result.truncated and result.info["truncated_reason"] == "max_turns"


async def test_observation_budget_is_declared_for_the_codec(corpus_path: Path) -> None:
    """Envs speak messages: the codec applies the budget (see test_episode.py), not the env."""
    env = await started(corpus_path, max_observation_tokens=20)
    assert env.max_observation_tokens == 20
    text = (await env.step(say("<search> capital city </search>"))).observation[0].content
    assert len(text) > 20 * 4 and "truncated" not in text
    assert text.startswith("\n\n<information>Doc 1(Title:") and text.endswith("</information>\n\n")


async def test_codec_tool_call_with_bad_json_is_a_tool_error(corpus_path: Path) -> None:
    env = await started(corpus_path)
    action = Message(
        role="assistant", content="", tool_calls=[ToolCall("search", '{"query": oops', "c1")]
    )
    result = await env.step(action)
    assert not result.terminated
    assert result.info["num_tool_calls"] == 1 and result.info["num_tool_errors"] == 1
    assert result.observation[0].tool_call_id == "c1"


async def test_codec_tool_call_id_is_kept_for_tagged_search(corpus_path: Path) -> None:
    env = await started(corpus_path)
    call = ToolCall("search", '{"query": "tomato"}', "call-7")
    result = await env.step(
        Message(role="assistant", content="<search> tomato </search>", tool_calls=[call])
    )
    assert result.observation[0].tool_call_id == "call-7"
    assert "Tomato" in result.observation[0].content


def test_bad_kwargs_name_the_field() -> None:
    with pytest.raises(ValueError, match="reward='bleu'"):
        SearchR1Env(reward="bleu")
    with pytest.raises(ValueError, match="retriever_url"):
        SearchR1Env(retriever="http")


class DeadRetriever:
    async def search(self, queries, topk):
        from agentrl_envs.search_r1.http_client import RetrieverUnavailableError

        raise RetrieverUnavailableError(
            "retrieval server down; start one with `agentrl retriever serve --corpus X`"
        )

    async def close(self) -> None:
        return None


async def test_retriever_dying_mid_episode_raises_not_scores(corpus_path: Path) -> None:
    """A dead server is infrastructure: step raises (the rollout records ERROR), never reward 0."""
    from agentrl_envs.search_r1.http_client import RetrieverUnavailableError

    env = await started(corpus_path)
    env.retriever = lambda: DeadRetriever()  # type: ignore[method-assign]
    with pytest.raises(RetrieverUnavailableError, match="agentrl retriever serve"):
        await env.step(say("<search> Paris </search>"))


@pytest.mark.slow
def test_check_env_passes_on_embedded_data() -> None:
    from agentrl.envs import check_env

    check_env("search_r1")


@pytest.mark.parametrize(
    ("text", "query"),
    [
        ("<search> capital of France </answer>", "capital of France"),  # closed with the wrong tag
        ("<search> capital of France", "capital of France"),  # never closed
    ],
)
async def test_lenient_search_reads_a_search_closed_with_another_tag(
    corpus_path: Path, text: str, query: str
) -> None:
    env = await started(corpus_path, lenient_search=True)
    result = await env.step(say(text))
    assert result.info["num_tool_calls"] == 1 and result.info["query"] == query
    assert "Paris" in result.observation[0].content
    strict = await started(corpus_path)  # Search-R1's rule: no action, the hint
    result = await strict.step(say(text))
    assert result.info["num_tool_calls"] == 0
    assert result.observation[0].content == INVALID_ACTION_HINT
    env = await started(corpus_path, lenient_search=True)
    result = await env.step(say("<search> </answer>"))  # an empty query is no search
    assert result.info["num_tool_calls"] == 0
