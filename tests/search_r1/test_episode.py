"""search_r1 through the real rollout path (ChatCodec in tags mode, run_episode) with a
scripted engine: observations and hints are masked, statuses and rewards come out right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agentrl_envs.search_r1.env import SearchR1Env
from agentrl_envs.search_r1.protocol import INVALID_ACTION_HINT

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.rollout import ChatCodec, run_episode
from agentrl.types import EpisodeStatus, StatusReason, Task

TASK = Task(
    id="t0", data={"question": "what is the capital of France", "golden_answers": ["Paris"]}
)


class ScriptedEngine:
    """Answers the k-th call with the k-th text; stops like an engine given the env's stop strings."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.stops = tokenizer, replies, []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        self.stops.append(tuple(sampling.stop))
        text = self.replies[min(len(self.stops) - 1, len(self.replies) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not any(text.endswith(s) for s in sampling.stop):
            ids.append(self.tokenizer.eos_token_id)
        return Completion(ids, [-0.5] * len(ids), FinishReason.STOP, "v0")


@pytest.fixture(scope="module")
def codec(smollm2_path: str) -> ChatCodec:
    return ChatCodec.from_pretrained(smollm2_path, tool_call_format="tags")


@pytest.fixture(scope="module")
def raw_codec(smollm2_path: str) -> ChatCodec:
    """Search-R1's base-model rendering: observation text right after the sampled ids."""
    return ChatCodec.from_pretrained(
        smollm2_path, tool_call_format="tags", observation_format="raw"
    )


_TOOL_TURN = "<|im_end|>\n<|im_start|>tool\n"
_NEXT_TURN = "<|im_end|>\n<|im_start|>assistant\n"


async def play(
    codec: ChatCodec, corpus_path: Path, replies: list[str], **env_kwargs
) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(codec.tokenizer, replies)
    env = SearchR1Env(corpus=str(corpus_path), **env_kwargs)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=128)
    traj = await run_episode(
        env,
        engine,
        codec,
        TASK,
        sampling,
        max_turns=5,
        max_context_len=4096,
        max_observation_tokens=500,
    )
    return traj, engine


def masked_text(codec: ChatCodec, traj: Any) -> str:
    ids = [
        t
        for t, m in zip(
            traj.token_ids[traj.prompt_len :], traj.loss_mask[traj.prompt_len :], strict=True
        )
        if m == 0
    ]
    return codec.decode(ids)


@pytest.mark.slow
async def test_search_then_answer_masks_information(codec: ChatCodec, corpus_path: Path) -> None:
    replies = [
        "<think>look it up</think>\n<search> capital of France </search>",
        "<think>found</think>\n<answer> Paris </answer>",
    ]
    traj, engine = await play(codec, corpus_path, replies)
    assert traj.status == EpisodeStatus.COMPLETED and traj.reward == 1.0
    assert set(engine.stops[0]) >= {"</search>", "</answer>"}
    masked = masked_text(codec, traj)
    # a chat turn of its own: the assistant turn closed, a tool turn, the next assistant turn
    assert masked.startswith(_TOOL_TURN + '\n\n<information>Doc 1(Title: "Paris")')
    assert masked.endswith("</information>\n\n" + _NEXT_TURN)
    sampled = codec.decode(
        [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m == 1]
    )
    assert "<information>" not in sampled and sampled.endswith("<answer> Paris </answer>")
    assert traj.info["num_searches"] == 1 and [t.num_tool_calls for t in traj.turns] == [1, 0]


@pytest.mark.slow
async def test_long_search_results_are_cut_by_the_codec_keeping_the_closing_tag(
    codec: ChatCodec, corpus_path: Path
) -> None:
    replies = ["<search> capital of France </search>", "<answer> Paris </answer>"]
    traj, _ = await play(codec, corpus_path, replies, max_observation_tokens=40)
    masked = masked_text(codec, traj)
    assert masked.startswith(_TOOL_TURN + "\n\n<information>Doc 1(Title:")
    assert "tokens truncated" in masked and masked.endswith("</information>\n\n" + _NEXT_TURN)
    assert traj.turns[0].num_observation <= 40 + 12  # the budget and the turn headers
    assert traj.status == EpisodeStatus.COMPLETED and traj.reward == 1.0


@pytest.mark.slow
async def test_invalid_action_hint_is_masked(codec: ChatCodec, corpus_path: Path) -> None:
    traj, _ = await play(codec, corpus_path, ["I will just guess.", "<answer> Lyon </answer>"])
    assert traj.status == EpisodeStatus.COMPLETED and traj.reward == 0.0
    # the hint is a user turn with the template's headers, not text right after <|im_end|>
    # (which the model sampled here: the delta completes its end-of-turn suffix)
    assert masked_text(codec, traj) == ("\n<|im_start|>user\n" + INVALID_ACTION_HINT + _NEXT_TURN)


@pytest.mark.slow
async def test_raw_rendering_appends_observations_after_the_sampled_ids(
    raw_codec: ChatCodec, corpus_path: Path
) -> None:
    replies = [
        "<think>look it up</think>\n<search> capital of France </search>",
        "<think>found</think>\n<answer> Paris </answer>",
    ]
    traj, _ = await play(raw_codec, corpus_path, replies)
    masked = masked_text(raw_codec, traj)
    assert masked.startswith('\n\n<information>Doc 1(Title: "Paris")')
    assert masked.endswith("</information>\n\n") and traj.reward == 1.0


@pytest.mark.slow
async def test_never_answering_is_truncated_at_max_turns(
    codec: ChatCodec, corpus_path: Path
) -> None:
    traj, engine = await play(codec, corpus_path, ["<search> Paris </search>"], max_turns=4)
    assert traj.status == EpisodeStatus.TRUNCATED and traj.status_reason == StatusReason.MAX_TURNS
    assert (
        len(traj.turns) == 5 and traj.info["num_searches"] == 4
    )  # 4 searches, then the final turn
    assert traj.reward == 0.0
