"""`agentrl serve`'s OpenAI routes in SGLang 0.5.23's shape, through the official client:
`prompt_token_ids`/`response_token_ids` per chat choice, `metadata.weight_version`, and
streaming that spells what the plain response does."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tiny_model_path):
    from agentrl.engine.local import LocalEngine
    from tests.support.servers import start_server_thread

    engine = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    thread = start_server_thread(engine)
    yield openai.OpenAI(base_url=f"{thread.url}/v1", api_key="unused"), engine
    thread.stop()
    asyncio.run(engine.close())


MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def test_chat_token_ids_and_weight_version_as_sglang_names_them(served):
    client, engine = served
    chat = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=5, temperature=0.0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = chat.choices[0].model_extra
    assert choice["response_token_ids"] == choice["token_ids"]
    assert len(choice["response_token_ids"]) == chat.usage.completion_tokens
    assert len(choice["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert chat.to_dict()["metadata"] == {"weight_version": str(engine.weight_version)}
    only_prompt = (
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=2, extra_body={"return_prompt_token_ids": True}
        )
        .choices[0]
        .model_extra
    )
    assert only_prompt["prompt_token_ids"] == choice["prompt_token_ids"]
    assert "response_token_ids" not in only_prompt


def test_streamed_chat_and_completion_spell_the_plain_response(served):
    client, _ = served
    kwargs = dict(model="m", max_tokens=6, temperature=0.0)
    plain = client.chat.completions.create(messages=MESSAGES, **kwargs)
    stream = client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    plain_text = client.completions.create(prompt="The sky is", **kwargs).choices[0].text
    streamed = client.completions.create(prompt="The sky is", stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == plain_text


def test_a_tool_parser_turns_call_text_into_openai_tool_calls(smollm2_path):
    """With the run's codec as tool parser (what `agentrl serve` should pass), a tool loop
    written for OpenAI sees `tool_calls` exactly as from the training endpoint."""
    from agentrl.engine.serve.app import create_app
    from agentrl.rollout.codec import ChatCodec
    from agentrl.types import Task
    from tests.agents.conftest import tool_agent
    from tests.rollout.conftest import ScriptedEngine, load_tokenizer
    from tests.support.servers import run_app_in_thread

    tokenizer = load_tokenizer(smollm2_path, "qwen_tools")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "It is 5."])
    parser = ChatCodec(tokenizer).parse
    app = create_app(engine, tokenizer=tokenizer, model_path="scripted", tool_parser=parser)
    thread = run_app_in_thread(app)
    try:
        client = openai.AsyncOpenAI(base_url=f"{thread.url}/v1", api_key="unused")
        task = Task("t", {"question": "What is 2 + 3?", "answer": 5})
        assert asyncio.run(tool_agent(task, client)) == 1.0
    finally:
        thread.stop()
    assert len(engine.calls) == 2  # the tool result went back; the model answered
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(engine.calls[1][0])


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([{"role": "wizard", "content": "Obey."}], "messages.0.role"),
        ([*MESSAGES, {"content": "no role"}], "messages.1.role"),
    ],
)
def test_a_message_without_a_chat_role_is_a_400_naming_it(served, messages, named):
    """OpenAI and SGLang refuse a role outside theirs; the template never sees it."""
    client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    message = refused.value.body["message"] if refused.value.body else str(refused.value)
    assert named in message and "\n" not in message
    client.chat.completions.create(
        model="m", messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES], max_tokens=2
    )  # SGLang's other roles pass


def test_models_report_the_engines_context_length(served):
    """`/v1/models` said the tokenizer's model_max_length, 1e30 for SmolLM2's (issue 39)."""
    import httpx

    client, engine = served
    card = client.models.list().data[0].model_extra
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    info = httpx.get(f"{root}/server_info").json()
    assert card["max_model_len"] == info["context_length"]
    assert 0 < card["max_model_len"] <= engine.model.config.max_position_embeddings
