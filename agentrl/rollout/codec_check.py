"""The codec self-check: replay synthetic multi-turn conversations incrementally (prompt, sampled
ids, observation deltas) and prove the ids equal a full render of the same conversation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.codec import ChatCodec, CodecCheckError
from agentrl.types import Message, ToolCall

_FIX = (
    "Use a prefix-preserving chat template, one that renders earlier turns the same way in every "
    "later prompt (e.g. keep earlier <think> blocks instead of dropping them): pass "
    "ChatCodec(tokenizer, chat_template=...) or set tokenizer.chat_template to a fixed template."
)


@dataclass
class CheckReport:
    num_conversations: int = 0
    num_tokens: int = 0
    """Tokens compared against full renders, over all conversations and variants."""
    skipped: list[str] = field(default_factory=list)
    """Conversations the template refused to render (e.g. several tool calls in one turn)."""


@dataclass
class _Conversation:
    name: str
    prompt: list[Message]
    turns: list[tuple[Message, list[Message]]]  # (assistant message, observation messages)


def check_codec(codec: ChatCodec, tools: list[dict[str, Any]] | None = None) -> CheckReport:
    """Prove on synthetic conversations that prompt + sampled ids + observation deltas equal a
    full render token for token (`tools`: the env's schemas); raise CodecCheckError naming the
    first differing token."""
    import jinja2

    tools = list(tools or []) or None

    report = CheckReport()
    if codec.observation_format == "raw":
        # Observations are raw text appended after the sampled ids: there is no template render to
        # match beyond the prompt, which must at least render.
        ids = codec.render_prompt([Message("user", "Question: why?")], tools)
        report.num_conversations = 1
        report.num_tokens = len(ids)
        return report
    conversations = (
        _tag_conversations(tools)
        if codec.tool_call_format == "tags"
        else _conversations(tools, renders_tool_calls=_renders_tool_calls(codec))
    )
    for conv in conversations:
        for stopped_on_eos in (True, False):
            try:
                report.num_tokens += _replay(codec, conv, tools, stopped_on_eos=stopped_on_eos)
            except jinja2.TemplateError as e:
                report.skipped.append(f"{conv.name}: {e}")
                break
        else:
            report.num_conversations += 1
    if not report.num_conversations:
        raise CodecCheckError(
            f"{codec.template_id} rendered none of the check conversations: {report.skipped}"
        )
    return report


def _replay(codec: ChatCodec, conv: _Conversation, tools: Any, *, stopped_on_eos: bool) -> int:
    messages = list(conv.prompt)
    ids = codec.render_prompt(messages, tools)
    eot = codec.end_of_turn_text
    eot_ids = codec.encode(eot)
    for assistant, observation in conv.turns:
        before = codec.render_text(messages, tools, add_generation_prompt=True)
        after = codec.render_text([*messages, assistant], tools)
        if not after.startswith(before) or not after.endswith(eot):
            raise CodecCheckError(
                f"{codec.template_id} is not prefix-preserving: in check conversation {conv.name!r} the "
                f"rendered assistant turn is not (generation prompt + content + {eot!r}):\n"
                f"generation prompt ends {before[-80:]!r}\nassistant render ends {after[-80:]!r}\n{_FIX}"
            )
        sampled_ids = codec.encode(after[len(before) : len(after) - len(eot)])
        if stopped_on_eos and eot_ids and eot_ids[0] in codec.stop_token_ids:
            sampled_ids.append(eot_ids[0])
        ids += sampled_ids + codec.render_observation(observation, sampled_ids=sampled_ids)
        messages += [assistant, *observation]
    full = codec.encode(codec.render_text(messages, tools, add_generation_prompt=True))
    if ids != full:
        raise CodecCheckError(_mismatch_message(codec, conv.name, stopped_on_eos, ids, full))
    return len(full)


def _mismatch_message(
    codec: ChatCodec, name: str, stopped_on_eos: bool, ids: list[int], full: list[int]
) -> str:
    i = next(
        (k for k, (a, b) in enumerate(zip(ids, full, strict=False)) if a != b),
        min(len(ids), len(full)),
    )

    def token(seq: list[int]) -> str:
        return repr(codec.decode([seq[i]])) if i < len(seq) else "<end of sequence>"

    how = "the model stopped on EOS" if stopped_on_eos else "the turn ended without EOS"
    return (
        f"{codec.template_id} is not prefix-preserving: replaying check conversation {name!r} ({how}), "
        f"incremental rendering (prompt + sampled ids + observation deltas, {len(ids)} tokens) differs "
        f"from a full render of the same conversation ({len(full)} tokens) at token {i}: incremental "
        f"{token(ids)} vs full render {token(full)}, after {codec.decode(full[max(0, i - 12) : i])!r}. "
        f"Sampled ids would be trained in a context the model never sees again. {_FIX}"
    )


def _renders_tool_calls(codec: ChatCodec) -> bool:
    """Templates without tool-call support (SmolLM2's) render only the content; the model then
    writes the Hermes block itself, so the check puts it in the content."""
    probe = Message("assistant", "", tool_calls=[ToolCall("agentrl_probe_tool", "{}", id="call_0")])
    try:
        return "agentrl_probe_tool" in codec.render_text([Message("user", "hi"), probe])
    except Exception:
        return False


def _call(tools: list[dict[str, Any]] | None, value: str, index: int) -> ToolCall:
    fn = (tools or [{}])[0].get("function", {}) or {}
    name = fn.get("name", "calculate")
    params = list(((fn.get("parameters") or {}).get("properties") or {"expression": {}}).keys())
    args = {params[0]: value} if params else {}
    return ToolCall(name, json.dumps(args, ensure_ascii=False), id=f"call_{index}")


def _assistant(content: str, calls: list[ToolCall], renders_tool_calls: bool) -> Message:
    if renders_tool_calls or not calls:
        return Message("assistant", content, tool_calls=calls)
    blocks = "".join(
        f'\n<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
        for c in calls
    )
    return Message("assistant", (content + blocks).lstrip("\n"))


def _conversations(
    tools: list[dict[str, Any]] | None, *, renders_tool_calls: bool
) -> list[_Conversation]:
    def a(content: str, *calls: ToolCall) -> Message:
        return _assistant(content, list(calls), renders_tool_calls)

    def tool(content: str, call: ToolCall) -> Message:
        return Message("tool", content, tool_call_id=call.id, name=call.name)

    c1, c2, c3, c4 = (
        _call(tools, v, i) for i, v in enumerate(["12 * 7", "2 + 2", "3 + 3", "√2 ≈ ?"])
    )
    return [
        _Conversation(
            "tool call, then a user hint",
            [
                Message("system", "You solve problems step by step."),
                Message("user", "What is 12 * 7?"),
            ],
            [
                (a("<think>\nI should use the tool.\n</think>\n\n", c1), [tool("84", c1)]),
                (
                    a("<think>\nThe tool says 84.\n</think>\n\nThe answer is 84."),
                    [Message("user", "Are you sure?")],
                ),
                (
                    a("<think>\nYes, 12 * 7 = 84.\n</think>\n\nYes: 84."),
                    [Message("user", "Thanks.")],
                ),
            ],
        ),
        _Conversation(
            "parallel tool calls, no system message",
            [Message("user", "Compute 2 + 2 and 3 + 3.")],
            [
                (a("", c2, c3), [tool("4", c2), tool("6", c3)]),
                (a("Both done: 4 and 6."), [Message("user", "Now multiply them.")]),
            ],
        ),
        _Conversation(
            "whitespace, unicode and JSON in observations",
            [Message("system", "Be brief."), Message("user", "  Roughly what is √2?  \n")],
            [
                (a("Let me check.", c4), [tool('  {"result": [1.4142, "≈"]}\n\n', c4)]),
                (a("About 1.41.\n"), [Message("user", "\nand with   spaces   ")]),
            ],
        ),
    ]


def _tag_conversations(tools: list[dict[str, Any]] | None) -> list[_Conversation]:
    """Search-R1-style turns: actions are tags in the assistant's text (a turn stops on the
    closing tag, or on EOS when it wrote none), replies are tool turns and user hints."""
    name = ((tools or [{}])[0].get("function", {}) or {}).get("name", "search")

    def a(content: str) -> Message:
        return Message("assistant", content)

    def tool(content: str, index: int) -> Message:
        return Message("tool", content, tool_call_id=f"{name}-{index}", name=name)

    docs = '\n\n<information>Doc 1(Title: "Hamlet") Hamlet is a tragedy by Shakespeare.\n</information>\n\n'
    hint = "\nMy previous action is invalid. Let me try again.\n"
    return [
        _Conversation(
            "tag action, tool reply, then a user hint",
            [Message("user", "Answer the given question. Question: who wrote Hamlet?\n")],
            [
                (
                    a(f"<think>\nI should look it up.\n</think>\n<{name}> Hamlet author </{name}>"),
                    [tool(docs, 1)],
                ),
                (a("<think>Shakespeare.</think> It was him."), [Message("user", hint)]),
                (a(f"<{name}>Hamlet\n</{name}>"), [tool('  √2 ≈ 1.41 {"x": [1]}\n', 3)]),
            ],
        ),
        _Conversation(
            "system message, unicode and whitespace",
            [Message("system", "Be brief."), Message("user", "  Roughly what is √2?  \n")],
            [
                (
                    a(f"<{name}> square root of 2 </{name}>"),
                    [tool("\n\n<information></information>\n\n", 1)],
                ),
                (a("<answer> 1.41 </answer>\n"), [Message("user", "\nand with   spaces   ")]),
            ],
        ),
    ]
