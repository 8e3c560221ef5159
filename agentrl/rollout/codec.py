"""`ChatCodec`: the only place messages become tokens. Prompts come from the model's chat
template, observations become token deltas appended after the sampled ids (which are never
re-tokenized), and tool calls are parsed from the sampled text."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Literal

from agentrl.model_store import eos_token_ids
from agentrl.rollout.tool_parser import parse_hermes, parse_tags, tag_parameters
from agentrl.tools.output import truncate_middle
from agentrl.types import Message

ToolCallFormat = Literal["hermes", "tags"]
ObservationFormat = Literal["chat", "raw"]

# A dummy assistant turn that observation deltas are rendered after (the SkyRL/verl trick):
# whatever the template writes between this marker and the next generation prompt is the delta.
_MARKER = "agentrl-codec-marker-7f3a"
_MARKED_TURN = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER})

# Templates that ignore `tools` (SmolLM2's) get the Hermes instructions in the system message,
# worded as Qwen2.5's template words them, so the model still sees the schemas.
_HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{schemas}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class CodecCheckError(RuntimeError):
    """The chat template cannot be rendered incrementally (it is not prefix-preserving)."""


class ChatCodec:
    """Turns messages into token ids and sampled ids into messages, for one tokenizer.

    `tool_call_format`: how actions are written, `"hermes"` (`<tool_call>{json}</tool_call>`)
    or `"tags"` (Search-R1's `<tool_name>argument</tool_name>`).
    `observation_format`: how env replies are rendered, `"chat"` (a turn of their own with the
    template's headers, after the assistant turn's end-of-turn suffix: what an instruct model
    was tuned on) or `"raw"` (their text right after the sampled ids, as Search-R1 does for
    base models).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_call_format: ToolCallFormat = "hermes",
        observation_format: ObservationFormat = "chat",
        chat_template: str | None = None,
    ) -> None:
        if tool_call_format not in ("hermes", "tags"):
            raise ValueError(f"tool_call_format={tool_call_format!r} is not one of: hermes, tags")
        if observation_format not in ("chat", "raw"):
            raise ValueError(
                f"observation_format={observation_format!r} is not one of: chat (instruct "
                "models), raw (base models)"
            )
        self.tokenizer = tokenizer
        self.tool_call_format: ToolCallFormat = tool_call_format
        self.observation_format: ObservationFormat = observation_format
        self.chat_template: str | None = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(
                f"tokenizer {self.name!r} has no chat template; pass ChatCodec(..., chat_template=...) "
                "or use an instruct checkpoint whose tokenizer_config.json carries one"
            )

    @classmethod
    def from_pretrained(cls, path: str, **options: Any) -> ChatCodec:
        """The codec of the tokenizer at `path` (a model dir or hub id); `options` as above."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), **options)

    # ------------------------------------------------------------ identity

    @property
    def name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__)

    @property
    def template_id(self) -> str:
        """`name_or_path (sha256:…)`: names the template in error messages."""
        digest = hashlib.sha256((self.chat_template or "").encode()).hexdigest()[:12]
        return f"{self.name} (chat template sha256:{digest})"

    @functools.cached_property
    def stop_token_ids(self) -> list[int]:
        """EOS and the first token of the end-of-turn suffix: generation stops on either."""
        ids = eos_token_ids(self.tokenizer)
        eot_ids = self.encode(self.end_of_turn_text)
        if eot_ids and self._is_special(eot_ids[0]) and eot_ids[0] not in ids:
            ids.append(eot_ids[0])
        return ids

    def _is_special(self, token_id: int) -> bool:
        return token_id in set(getattr(self.tokenizer, "all_special_ids", []) or []) or (
            self.tokenizer.convert_ids_to_tokens(token_id) in self._added_special_tokens
        )

    @functools.cached_property
    def _added_special_tokens(self) -> set[str]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return {str(t) for t in decoder.values() if getattr(t, "special", False)}

    # ------------------------------------------------------------ text <-> ids

    def encode(self, text: str) -> list[int]:
        """Tokenize text exactly as written: the template supplies BOS and role tokens itself."""
        if self._backend is not None:  # the Rust tokenizer directly: ~3x less overhead per call
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @functools.cached_property
    def _backend(self) -> Any:
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def render_text(
        self, messages: list[Message], tools: Any = None, *, add_generation_prompt: bool = False
    ) -> str:
        """The template's rendering of `messages` (with tools), as text."""
        schemas = _schemas(tools) if self.tool_call_format == "hermes" else None
        conversation = [_template_dict(m) for m in messages]
        if schemas and not self._template_renders_tools:
            conversation = _with_tools_in_system(conversation, schemas)
            schemas = None
        return self._render_dicts(
            conversation, schemas, add_generation_prompt=add_generation_prompt
        )

    @functools.cached_property
    def _template_renders_tools(self) -> bool:
        probe = {
            "type": "function",
            "function": {"name": _MARKER, "description": "", "parameters": {}},
        }
        return _MARKER in self._render_dicts([{"role": "user", "content": "hi"}], [probe])

    # ------------------------------------------------------------ prompt and observations

    def render_prompt(self, messages: list[Message], tools: Any = None) -> list[int]:
        """Prompt ids: the template's rendering with the generation prompt, tokenized once."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=True))

    def render_observation(
        self, messages: list[Message], *, sampled_ids: list[int] | None = None
    ) -> list[int]:
        """Ids to append after `sampled_ids` so the sequence reads as the template would render
        the conversation with `messages` added, up to the next generation prompt.

        chat: the end-of-turn suffix (minus whatever of it the model already sampled, e.g. an
        EOS that is `<|im_end|>`), then the messages and the generation prompt as the template
        renders them after an assistant turn. raw: the messages' text, as written.
        """
        if self.observation_format == "raw":
            return self.encode("".join(m.content for m in messages)) if messages else []
        return self.encode(
            self._pending_end_of_turn(sampled_ids or []) + self._observation_text(messages)
        )

    def cut_observation(self, messages: list[Message], max_tokens: int | None) -> list[Message]:
        """Cut message texts so together they hold about `max_tokens` tokens (the budget the
        env declares, or the runner's if smaller), keeping each one's head and tail. Short
        messages keep all of theirs; long ones share what is left."""
        if max_tokens is None or not messages:
            return messages
        if sum(len(m.content.encode()) for m in messages) <= max_tokens:  # a token is >= 1 byte
            return messages
        counts = [len(self.encode(m.content)) for m in messages]
        if sum(counts) <= max_tokens:
            return messages
        budgets = [0] * len(messages)
        remaining = max_tokens
        for rank, i in enumerate(sorted(range(len(messages)), key=counts.__getitem__)):
            budgets[i] = min(counts[i], remaining // (len(messages) - rank))
            remaining -= budgets[i]
        return [
            dataclasses.replace(m, content=truncate_middle(m.content, max(budgets[i], 1), self))
            if counts[i] > budgets[i]
            else m
            for i, m in enumerate(messages)
        ]

    @functools.cached_property
    def end_of_turn_text(self) -> str:
        """What the template writes after an assistant message's content (`<|im_end|>\\n`)."""
        text = self._render_dicts(list(_MARKED_TURN))
        return text[text.rindex(_MARKER) + len(_MARKER) :]

    def _pending_end_of_turn(self, sampled_ids: list[int]) -> str:
        """The part of the end-of-turn suffix the sampled ids do not already end with."""
        eot_ids, rests = self._end_of_turn_pieces
        for k in range(min(len(eot_ids), len(sampled_ids)), 0, -1):
            if sampled_ids[-k:] == eot_ids[:k]:
                return rests[k]
        return self.end_of_turn_text

    @functools.cached_property
    def _end_of_turn_pieces(self) -> tuple[list[int], list[str]]:
        """The suffix's ids, and for each k the text left once its first k ids were sampled."""
        eot_ids = self.encode(self.end_of_turn_text)
        rests = [
            self.end_of_turn_text[len(self.decode(eot_ids[:k])) :] for k in range(len(eot_ids) + 1)
        ]
        return eot_ids, rests

    def _observation_text(self, messages: list[Message]) -> str:
        text = self._render_dicts(
            [*_MARKED_TURN, *(_template_dict(m) for m in messages)], add_generation_prompt=True
        )
        anchor = _MARKER + self.end_of_turn_text
        if anchor not in text:
            raise CodecCheckError(
                f"{self.template_id}: after an assistant message followed by "
                f"{[m.role for m in messages]} messages, the template no longer writes the end-of-turn "
                f"suffix {self.end_of_turn_text!r}, so observations cannot be appended as a token delta; "
                "use a prefix-preserving chat template"
            )
        return text[text.index(anchor) + len(anchor) :]

    def _render_dicts(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    # ------------------------------------------------------------ parsing

    def strip_end_of_turn(self, sampled_ids: list[int]) -> list[int]:
        """Sampled ids without the trailing EOS / end-of-turn token(s)."""
        stop = set(self.stop_token_ids)
        end = len(sampled_ids)
        while end and sampled_ids[end - 1] in stop:
            end -= 1
        return sampled_ids[:end]

    def parse(self, sampled_ids: list[int], tools: Any = None) -> Message:
        """The assistant message the sampled ids spell: content plus tool calls. `tools` (schemas
        or a ToolRegistry) name the tags the `tags` format recognises."""
        text = self.decode(self.strip_end_of_turn(sampled_ids))
        eot = self.end_of_turn_text.strip()
        if eot and text.rstrip().endswith(eot):
            text = text.rstrip()[: -len(eot)]
        if self.tool_call_format == "tags":
            return parse_tags(text, tag_parameters(_schemas(tools)))
        return parse_hermes(text)


def _schemas(tools: Any) -> list[dict[str, Any]] | None:
    """Accept a ToolRegistry, a list of schemas, or None."""
    if tools is None:
        return None
    schemas = tools.schemas() if hasattr(tools, "schemas") else list(tools)
    return schemas or None


def _template_dict(message: Message) -> dict[str, Any]:
    """Message -> the dict HF templates read: tool-call arguments as objects, not JSON text."""
    d = message.to_dict()
    for tc in d.get("tool_calls", []):
        fn = tc["function"]
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except (json.JSONDecodeError, TypeError):
            pass
    return d


def _with_tools_in_system(
    conversation: list[dict[str, Any]], schemas: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    block = _HERMES_TOOLS_PROMPT.format(
        schemas="".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
    )
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0], content=conversation[0]["content"] + "\n\n" + block)
        return [first, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]
