"""An unmodified OpenAI-client agent through the episode endpoint: token-exact segments, tool
output masked, calls that extend a conversation merged, a rewritten history a new segment."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.agents import AgentResult
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.codec_check import check_codec
from agentrl.types import EpisodeStatus, Message, StatusReason, Task
from tests.agents.conftest import ADD_TOOL, run_agent_once, tool_agent
from tests.rollout.conftest import ScriptedEngine

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TASK = Task(id="t0", data={"question": "What is 2 + 3?", "answer": 5})


async def _run(engine: Any, codec: ChatCodec, agent: Any, **limits: Any) -> list:
    return await run_agent_once(engine, codec, agent, **limits)


async def test_tool_loop_is_one_token_exact_trajectory_with_tool_output_masked(qwen_tokenizer):
    codec = ChatCodec(qwen_tokenizer)
    check_codec(codec, [ADD_TOOL])
    engine = ScriptedEngine(qwen_tokenizer, [CALL, "The answer is 5."])
    [traj] = await _run(engine, codec, tool_agent)
    traj.check()
    assert (traj.status, traj.reward, traj.info["num_calls"]) == (EpisodeStatus.COMPLETED, 1.0, 2)
    first, second = traj.turns
    # What the engine was given and sampled is what the trajectory holds, id for id.
    assert engine.calls[1][0] == traj.token_ids[: second.start]
    assert (
        traj.token_ids[first.start : first.start + first.num_sampled] == engine.completions[0].ids
    )
    assert traj.logprobs == engine.completions[0].logprobs + engine.completions[1].logprobs
    # The prompt is a full render; the tool reply is the codec's delta, masked.
    messages = [
        Message("system", "Use the add tool, then answer."),
        Message("user", "What is 2 + 3?"),
    ]
    assert traj.token_ids[: traj.prompt_len] == codec.render_prompt(messages, [ADD_TOOL])
    obs = traj.token_ids[first.start + first.num_sampled : second.start]
    assert codec.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.loss_mask[first.start + first.num_sampled : second.start] == [0] * len(obs)
    assert first.num_observation == len(obs) and first.num_tool_calls == 1
    # The whole sequence reads as the template renders the conversation (sampled ids unchanged).
    full = codec.render_text(
        [*messages, Message.from_dict({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}),
         Message("tool", "5", tool_call_id="c"), Message("assistant", "The answer is 5.")],
        [ADD_TOOL],
    )  # fmt: skip
    assert codec.decode(traj.token_ids) + "\n" == full


async def rewriting_agent(task: Any, client: Any) -> float:
    """Asks, then asks again with a compacted history: a second segment."""
    first = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "long history " * 5}]
    )
    summary = first.choices[0].message.content or ""
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": f"Summary: {summary}. Go on."}]
    )
    return AgentResult(answer="<answer>5</answer>")  # the env scores it


async def test_rewritten_history_starts_a_segment_and_the_env_scores_the_result(qwen_tokenizer):
    codec = ChatCodec(qwen_tokenizer)
    engine = ScriptedEngine(qwen_tokenizer, ["short", "done"])
    trajs = await _run(engine, codec, rewriting_agent)
    assert [t.info["segment"] for t in trajs] == [0, 1]
    assert all(t.reward == 1.0 and t.status is EpisodeStatus.COMPLETED for t in trajs)
    assert all(t.episode_id == "g/0" and t.num_turns == 1 for t in trajs)
    for traj, completion in zip(trajs, engine.completions, strict=True):
        traj.check()
        assert traj.token_ids[traj.prompt_len :] == completion.ids


async def n_and_stream_agent(task: Any, client: Any) -> float:
    response = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], n=2
    )
    assert len(response.choices) == 2
    stream = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}, response.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}], stream=True
    )  # fmt: skip
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    return 1.0 if text == "three" else 0.0


async def test_n_choices_branch_and_a_stream_continues_the_chosen_one(qwen_tokenizer):
    codec = ChatCodec(qwen_tokenizer)
    engine = ScriptedEngine(qwen_tokenizer, ["one", "two", "three"])
    trajs = await _run(engine, codec, n_and_stream_agent)
    # choice 0 was left as is; choice 1 was continued by the streamed call: two leaves.
    assert [t.num_turns for t in trajs] == [1, 2]
    assert all(t.reward == 1.0 for t in trajs)
    assert codec.decode(trajs[1].token_ids[trajs[1].turns[1].start :]).startswith("three")


async def failing_agent(task: Any, client: Any) -> float:
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent's own bug")


async def test_agent_exception_is_error_not_zero(qwen_tokenizer):
    [traj] = await _run(
        ScriptedEngine(qwen_tokenizer, ["x"]), ChatCodec(qwen_tokenizer), failing_agent
    )
    assert (traj.status, traj.status_reason) == (EpisodeStatus.ERROR, StatusReason.ENV)
    assert "the agent's own bug" in traj.info["error"] and not traj.status.is_trainable


async def looping_agent(task: Any, client: Any) -> float:
    messages = [{"role": "user", "content": "hi"}]
    while True:  # never stops by itself: the call limit ends it
        r = await client.chat.completions.create(model="p", messages=messages)
        messages += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "go"},
        ]


async def test_call_limit_truncates_and_timeout_errors(qwen_tokenizer):
    codec = ChatCodec(qwen_tokenizer)
    [traj] = await _run(ScriptedEngine(qwen_tokenizer, ["x"]), codec, looping_agent, max_calls=2)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.TRUNCATED, StatusReason.MAX_TURNS)
    assert traj.num_turns == 2
    slow = ScriptedEngine(qwen_tokenizer, ["x"], delay_s=5)
    [traj] = await _run(slow, codec, looping_agent, timeout_s=0.5)
    assert traj.status is EpisodeStatus.ERROR and "no result after" in traj.info["error_where"]


@pytest.mark.parametrize("path", ["nocolon", "tests.agents.conftest:ADD_TOOL", "no_such_mod:run"])
def test_load_agent_names_the_field(path):
    from agentrl.agents import load_agent

    with pytest.raises(ValueError, match=r"rollout\.agent="):
        load_agent(path)


async def anthropic_agent(task: Any, client: Any) -> float:
    """The same tool loop in Anthropic's Messages shape (raw HTTP: the SDK is not installed)."""
    import httpx

    url = str(client.base_url).rstrip("/") + "/messages"
    tools = [{"name": "add", "description": "Add two integers.",
              "input_schema": ADD_TOOL["function"]["parameters"]}]  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.data["question"]}]
    async with httpx.AsyncClient() as http:
        for _ in range(2):
            body = {"model": "p", "max_tokens": 128, "system": "Use the add tool, then answer.",
                    "messages": messages, "tools": tools}  # fmt: skip
            reply = (await http.post(url, json=body)).json()
            messages.append({"role": "assistant", "content": reply["content"]})
            uses = [b for b in reply["content"] if b["type"] == "tool_use"]
            if reply["stop_reason"] != "tool_use":
                return 1.0 if "5" in reply["content"][0]["text"] else 0.0
            results = [{"type": "tool_result", "tool_use_id": b["id"],
                        "content": str(b["input"]["a"] + b["input"]["b"])} for b in uses]  # fmt: skip
            messages.append({"role": "user", "content": results})
    return 0.0


async def test_anthropic_messages_shape_records_the_same_trajectory(qwen_tokenizer):
    codec = ChatCodec(qwen_tokenizer)
    openai_run = await _run(
        ScriptedEngine(qwen_tokenizer, [CALL, "The answer is 5."]), codec, tool_agent
    )
    anthropic_run = await _run(
        ScriptedEngine(qwen_tokenizer, [CALL, "The answer is 5."]), codec, anthropic_agent
    )
    [a], [b] = openai_run, anthropic_run
    assert (b.status, b.reward, b.num_turns) == (EpisodeStatus.COMPLETED, 1.0, 2)
    assert (b.token_ids, b.loss_mask, b.logprobs) == (a.token_ids, a.loss_mask, a.logprobs)
