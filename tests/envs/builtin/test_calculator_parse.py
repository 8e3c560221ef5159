"""The calculator's answer and arithmetic parses read an action once (issue 38: the old
`<answer>(.*?)</answer>` rescanned the text from every unclosed tag; 125 KiB took 13 s, a MiB
about 14 minutes -- under the old code the 1 MiB cases below would not finish)."""

from __future__ import annotations

import re

import pytest

from agentrl.envs.builtin.calculator import last_answer_block, parse_answer, repair_call
from agentrl.types import ToolCall

OLD_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@pytest.mark.parametrize(
    "text",
    [
        "<answer>42</answer>",
        "first <answer>1</answer> then <ANSWER>2</Answer>",
        "<answer>1<answer>2</answer>",  # an opener inside an open block is text
        "<answer>1</answer> 5 </answer>",  # a stray closer is text
        "<answer>unclosed 7",
        "</answer><answer>\n3\n</answer>",
        "no tags 9",
    ],
)
def test_the_last_block_is_the_one_the_old_regex_found(text: str) -> None:
    old = OLD_ANSWER_TAG.findall(text)
    assert last_answer_block(text) == (old[-1] if old else None)


def test_a_mebibyte_of_unclosed_tags_is_read_once() -> None:
    text = "<answer>" * (2**20 // 8) + "12"
    assert parse_answer(text) == (12.0, False)
    assert parse_answer(text + "</answer>") == (12.0, True)


def test_a_mebibyte_of_open_parentheses_in_a_call_is_read_once() -> None:
    call = ToolCall(name="calculate", arguments="(" * 2**20 + " oops 3 * 4")
    assert repair_call(call).arguments == '{"expression": "3 * 4"}'
