"""ChatCodec: incremental rendering equals a full render for three template families, the
history-rewriting template is rejected with a clear message, and parsing never raises."""

from __future__ import annotations

import json

import pytest

from agentrl.rollout.codec import ChatCodec, CodecCheckError
from agentrl.rollout.codec_check import check_codec
from agentrl.types import Message, ToolCall

from .conftest import load_tokenizer

CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


@pytest.fixture(scope="module", params=["smollm2", "qwen_tools", "llama3"])
def family_codec(request: pytest.FixtureRequest, smollm2_path: str) -> ChatCodec:
    template = None if request.param == "smollm2" else request.param
    return ChatCodec(load_tokenizer(smollm2_path, template))


@pytest.fixture(scope="module")
def smol_codec(smollm2_path: str) -> ChatCodec:
    return ChatCodec(load_tokenizer(smollm2_path))


@pytest.mark.parametrize("tools", [None, [CALC_SCHEMA]], ids=["no-tools", "tools"])
def test_check_passes_for_prefix_preserving_families(
    family_codec: ChatCodec, tools: list | None
) -> None:
    report = check_codec(family_codec, tools)
    assert report.num_conversations >= 2
    assert report.num_tokens > 500


def test_check_rejects_template_that_drops_earlier_think_blocks(smollm2_path: str) -> None:
    codec = ChatCodec(load_tokenizer(smollm2_path, "drops_think"))
    with pytest.raises(CodecCheckError) as info:
        check_codec(codec, [CALC_SCHEMA])
    message = str(info.value)
    assert "not prefix-preserving" in message
    assert "chat template sha256:" in message and codec.template_id in message
    assert "at token " in message
    # both tokens are shown decoded: the replay still has the <think> block, the full render does not
    assert "incremental 'think' vs full render 'tool'" in message
    assert "keep earlier <think> blocks" in message


def test_llama3_check_skips_conversations_the_template_refuses(smollm2_path: str) -> None:
    report = check_codec(ChatCodec(load_tokenizer(smollm2_path, "llama3")), [CALC_SCHEMA])
    assert any("single tool-calls" in s for s in report.skipped)


def test_observation_delta_completes_the_turn_whether_or_not_eos_was_sampled(
    family_codec: ChatCodec,
) -> None:
    prompt = [Message("system", "Be brief."), Message("user", "2 + 2?")]
    reply = Message("assistant", "It is 4.")
    hint = [Message("user", "Sure?")]
    before = family_codec.render_text(prompt, add_generation_prompt=True)
    content = family_codec.render_text([*prompt, reply])[len(before) :].removesuffix(
        family_codec.end_of_turn_text
    )
    sampled = family_codec.encode(content)
    eos = family_codec.stop_token_ids[-1]
    full = family_codec.encode(
        family_codec.render_text([*prompt, reply, *hint], add_generation_prompt=True)
    )

    with_eos = family_codec.render_observation(hint, sampled_ids=[*sampled, eos])
    without_eos = family_codec.render_observation(hint, sampled_ids=sampled)

    prompt_ids = family_codec.render_prompt(prompt)
    assert prompt_ids + sampled + [eos] + with_eos == full
    assert prompt_ids + sampled + without_eos == full
    assert without_eos[0] == eos and len(without_eos) == len(with_eos) + 1


def test_templates_without_tool_support_still_show_the_schemas(smol_codec: ChatCodec) -> None:
    text = smol_codec.render_text(
        [Message("user", "hi")], [CALC_SCHEMA], add_generation_prompt=True
    )
    assert json.dumps(CALC_SCHEMA) in text
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def test_parse_hermes_tool_calls_and_content(smol_codec: ChatCodec) -> None:
    text = (
        "<think>need both</think>\n"
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 2"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    )
    ids = smol_codec.encode(text) + [smol_codec.tokenizer.eos_token_id]
    message = smol_codec.parse(ids)
    assert message.role == "assistant"
    assert message.content == "<think>need both</think>"
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("calculate", {"expression": "2 + 2"}),
        ("search", {"query": "x"}),
    ]
    assert message.tool_calls[0].id != message.tool_calls[1].id


@pytest.mark.parametrize(
    ("block", "name"),
    [
        ('{"name": "calculate", "arguments": {"expression": "2 +', "calculate"),  # cut off (length)
        ('{"name": "calculate", arguments: {expression: 2}}', "calculate"),  # not JSON
        ("calculate(2 + 2)", ""),  # no name to find
        ('["calculate"]', ""),  # JSON, wrong shape
    ],
)
def test_parse_malformed_tool_call_keeps_raw_text_for_the_registry(
    smol_codec: ChatCodec, block: str, name: str
) -> None:
    message = smol_codec.parse(smol_codec.encode(f"<tool_call>{block}</tool_call>"))
    assert message.tool_calls == [ToolCall(name=name, arguments=block, id="call_0")]


def test_parse_unclosed_tool_call_at_the_token_limit(smol_codec: ChatCodec) -> None:
    message = smol_codec.parse(
        smol_codec.encode('Let me see.\n<tool_call>\n{"name": "calculate", "argu')
    )
    assert message.content == "Let me see."
    assert message.tool_calls[0].name == "calculate"


def test_parse_strips_end_of_turn_and_keeps_plain_answers(smol_codec: ChatCodec) -> None:
    eos = smol_codec.tokenizer.eos_token_id
    message = smol_codec.parse(smol_codec.encode("The answer is <answer>4</answer>") + [eos])
    assert message.content == "The answer is <answer>4</answer>"
    assert message.tool_calls == []


def test_tags_format_parses_search_r1_actions_and_appends_raw_observations(
    smollm2_path: str,
) -> None:
    codec = ChatCodec(
        load_tokenizer(smollm2_path), tool_call_format="tags", observation_format="raw"
    )
    text = "<think>who?</think><search> capital of France </search>"
    message = codec.parse(codec.encode(text), [SEARCH_SCHEMA])
    assert message.tool_calls == [
        ToolCall("search", json.dumps({"query": "capital of France"}), id="call_0")
    ]
    assert (
        codec.parse(codec.encode("<answer> Paris </answer>"), [SEARCH_SCHEMA]).content
        == "<answer> Paris </answer>"
    )

    observation = "\n\n<information>Doc 1(Title: Paris) Paris is the capital.</information>\n\n"
    assert codec.render_observation([Message("user", observation)]) == codec.encode(observation)
    # Search-R1 prompts describe the tags themselves: no tool block in the prompt
    assert "<tools>" not in codec.render_text([Message("user", "q")], [SEARCH_SCHEMA])
    assert check_codec(codec, [SEARCH_SCHEMA]).num_conversations == 1


@pytest.fixture(scope="module", params=["smollm2", "qwen_tools", "llama3"])
def tags_chat_codec(request: pytest.FixtureRequest, smollm2_path: str) -> ChatCodec:
    template = None if request.param == "smollm2" else request.param
    return ChatCodec(load_tokenizer(smollm2_path, template), tool_call_format="tags")


def test_tags_with_chat_observations_pass_the_token_exact_check(
    tags_chat_codec: ChatCodec,
) -> None:
    report = check_codec(tags_chat_codec, [SEARCH_SCHEMA])
    assert report.num_conversations == 2 and not report.skipped
    assert report.num_tokens > 300  # whole conversations compared, not just a prompt


def test_tags_chat_observation_is_a_turn_with_the_templates_headers(smollm2_path: str) -> None:
    """A search stops on `</search>` (no EOS): the delta closes the assistant turn, opens a tool
    turn and the next assistant turn, and equals a full render of the conversation."""
    codec = ChatCodec(load_tokenizer(smollm2_path), tool_call_format="tags")
    prompt = [Message("user", "Question: capital of France?")]
    action = "<think>who?</think>\n<search> capital of France </search>"
    sampled = codec.encode(action)
    observation = [
        Message("tool", "\n\n<information>Doc 1 Paris.</information>\n\n", name="search")
    ]

    delta = codec.decode(codec.render_observation(observation, sampled_ids=sampled))

    assert delta == (
        "<|im_end|>\n<|im_start|>tool\n\n\n<information>Doc 1 Paris.</information>\n\n"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    full = codec.render_prompt([*prompt, Message("assistant", action), *observation])
    ids = codec.render_prompt(prompt) + sampled
    assert ids + codec.render_observation(observation, sampled_ids=sampled) == full


def test_tags_chat_check_catches_a_template_that_rewrites_history(smollm2_path: str) -> None:
    codec = ChatCodec(load_tokenizer(smollm2_path, "drops_think"), tool_call_format="tags")
    with pytest.raises(CodecCheckError, match="not prefix-preserving"):
        check_codec(codec, [SEARCH_SCHEMA])


def test_unknown_observation_format_is_a_clear_error(smollm2_path: str) -> None:
    with pytest.raises(ValueError, match="observation_format='text' is not one of: chat"):
        ChatCodec(load_tokenizer(smollm2_path), observation_format="text")  # type: ignore[arg-type]


def test_unknown_format_and_missing_template_are_clear_errors(smollm2_path: str) -> None:
    tok = load_tokenizer(smollm2_path)
    with pytest.raises(ValueError, match="tool_call_format='xml' is not one of: hermes, tags"):
        ChatCodec(tok, tool_call_format="xml")  # type: ignore[arg-type]
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatCodec(tok)


def test_cut_observation_shares_the_budget(smol_codec: ChatCodec) -> None:
    short, long = Message("tool", "ok"), Message("tool", " ".join(f"w{i}" for i in range(500)))
    cut = smol_codec.cut_observation([short, long], 100)
    assert cut[0] is short
    assert 90 <= len(smol_codec.encode(cut[1].content)) <= 100 + 2  # + merges at the cut
    assert smol_codec.cut_observation([short], 100) == [short]
