"""`SearchR1Env`: retrieval-augmented QA with Search-R1's prompt, tags, observations and rewards."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from agentrl_envs.search_r1 import embedded, natural, tasks
from agentrl_envs.search_r1.bm25 import BM25Retriever
from agentrl_envs.search_r1.http_client import HTTPRetriever, RetrieverUnavailableError
from agentrl_envs.search_r1.protocol import (
    INVALID_ACTION_HINT,
    PROMPT_TEMPLATE,
    STOP,
    format_documents,
    format_observation,
    make_prompt,
    parse_action,
)
from agentrl_envs.search_r1.retrieval import Retriever
from agentrl_envs.search_r1.reward import (
    DEFAULT_FORMAT_WEIGHT,
    REWARD_KINDS,
    FormatScores,
    f1_with_format,
    pick_reward,
    score_response,
)

from agentrl.envs import AgentEnv, StepResult
from agentrl.tools import ToolRegistry, tool
from agentrl.types import Message, StatusReason, Task, ToolCall

_RETRIEVERS: dict[tuple[str, ...], Retriever] = {}

# The recipe's prompt and the worked episode of `demonstration=True` show the policy that works
# at 135M: search with the question as written, then read the answer out of the documents and
# give it in a few words. The instruction comes after the question (the model follows what it
# read last): measured with the earlier title prompt, 0 of 8 greedy first turns searched with
# the instruction before the question, 8 of 8 with it after.
# The worked episode's answer is a span of Doc 1's text, not its title: the previous recipe's
# "reply with its title" taught a 135M policy to copy Doc 1's title for every question (EM
# 0.082 -> 0.086 on 220 natural questions). For a base model use the paper's prompt
# (`protocol.PROMPT_TEMPLATE`, the default of the env).
ANSWER_PROMPT_TEMPLATE = (
    "Question: {question}\nFirst search for the question: reply with <search> and the question "
    "</search>. When the documents come back, find the answer in them and reply with it in a "
    "few words between <answer> and </answer>.\n"
)
SEARCH_FIRST_HINT = (
    "\nMy previous action is invalid. I should first search by writing <search> and the "
    "question </search>, then give the answer in a few words from the documents between "
    "<answer> and </answer>.\n"
)
"""The recipe's invalid-action hint: on one H100, first turns that went wrong and then searched
after Search-R1's own hint were among the few right answers of step 1."""
DEMONSTRATION_QUESTION = "Which river does Paris stand on?"
DEMONSTRATION_DOCUMENTS: tuple[str, ...] = (
    '"Paris"\nParis is the capital and largest city of France. It stands on the Seine river, in '
    "the north of the country.",
    '"France"\nFrance is a country in Western Europe. Its capital is Paris.',
    '"Loire"\nThe Loire is the longest river in France.',
)
"""The worked episode's documents; it shows as many as the env's `topk`."""
DEMONSTRATION_ANSWER = "Seine"


def demonstration_turns(topk: int) -> tuple[tuple[str, str], ...]:
    """(role, text) of the worked episode after its question: search with the question, the
    top `topk` documents, the answer read from Doc 1's text."""
    documents = format_documents(list(DEMONSTRATION_DOCUMENTS[:topk]))
    return (
        ("assistant", f"<search> {DEMONSTRATION_QUESTION} </search>"),
        ("tool", format_observation(documents)),
        ("assistant", f"<answer> {DEMONSTRATION_ANSWER} </answer>"),
    )


def shared_retriever(kind: str, *, url: str | None = None, corpus: str | None = None) -> Retriever:
    """One retriever per backend per process, so concurrent episodes share its batcher and cache."""
    key = (kind, url or "", corpus or "")
    if key not in _RETRIEVERS:
        _RETRIEVERS[key] = HTTPRetriever(url) if kind == "http" else BM25Retriever(corpus or "")
    return _RETRIEVERS[key]


@dataclass
class _Episode:
    task: Task
    golden_answers: list[str]
    num_turns: int = 0
    num_searches: int = 0
    num_invalid_actions: int = 0
    answer_text: str = ""  # the assistant's own text: where the answer is looked for
    transcript: str = ""  # assistant turns and observations in order: the format check reads it


class SearchR1Env(AgentEnv):
    """Answer a question, searching a corpus with `<search> query </search>` up to `max_turns`
    times; one more turn follows without search, for the final `<answer>`.

    Reward (`reward=`): "em" (SQuAD exact match of the last `<answer>` of the response),
    "f1", "format" (Search-R1's format-aware score), "f1_format" (0.9 x token F1 plus
    `format_weight` for an answer given after a search, see `reward.f1_with_format`) or
    "em_f1_format" (exact match leads, F1 pays at most half for a near miss: `reward.em_led`).
    Retrieval: the embedded BM25 index (`retriever="bm25"`, optionally over `corpus=PATH`) or
    any Search-R1 server (`retriever_url="http://127.0.0.1:8000"`). `demonstration=True` puts
    one worked episode (search with the question, `topk` documents, a one-word answer read
    from Doc 1's text) before the
    question as chat turns: small instruct models otherwise never write the tags (the paper's
    prompt alone is the default). `lenient_search=True` takes a turn that opens `<search>` and
    closes it with another tag (`</answer>`) or not at all as a search: the bundled model did
    so in 113 of its 139 greedy first turns that opened a search (200 test questions, one
    H100), which Search-R1's rule reads as no action. `reward_components` also count the
    episode's searches (`searches`, `searched`), so evaluations report them with intervals.
    """

    tool_call_format: ClassVar = "tags"
    stop: ClassVar[tuple[str, ...]] = STOP
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    metadata: ClassVar[dict[str, Any]] = {
        "paper": "arXiv:2503.09516",
        "source": "PeterGriffinJin/Search-R1",
    }

    def __init__(
        self,
        *,
        retriever: str = "bm25",
        retriever_url: str | None = None,
        corpus: str | None = None,
        topk: int = 3,
        max_turns: int = 4,
        use_final_answer_turn: bool = True,
        max_observation_tokens: int | None = 500,
        reward: str = "em",
        format_scores: dict[str, float] | None = None,
        format_weight: float = DEFAULT_FORMAT_WEIGHT,
        prompt_template: str = PROMPT_TEMPLATE,
        invalid_action_hint: str = INVALID_ACTION_HINT,
        demonstration: bool = False,
        lenient_search: bool = False,
        seed: int = embedded.DEFAULT_SEED,
    ) -> None:
        super().__init__()
        if retriever not in ("bm25", "http"):
            raise ValueError(
                f"retriever={retriever!r}: use 'bm25' (embedded) or 'http' with retriever_url=..."
            )
        if reward not in REWARD_KINDS:
            raise ValueError(f"reward={reward!r}: use one of {', '.join(REWARD_KINDS)}")
        if topk < 1 or max_turns < 0:
            raise ValueError(
                f"topk={topk}, max_turns={max_turns}: need topk >= 1 and max_turns >= 0"
            )
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template must contain '{question}'")
        self.retriever_kind = "http" if retriever_url else retriever
        self.retriever_url = retriever_url
        if self.retriever_kind == "http" and not retriever_url:
            raise ValueError(
                "retriever='http' needs retriever_url='http://HOST:PORT' (start one with `agentrl retriever serve`)"
            )
        self.corpus = corpus
        self.topk = topk
        self.max_turns = max_turns
        self.use_final_answer_turn = use_final_answer_turn
        self.max_observation_tokens = max_observation_tokens
        self.reward_kind = reward
        self.format_scores = FormatScores(**(format_scores or {}))
        f1_with_format(0.0, False, format_weight)  # raises on a bad weight, naming the field
        self.format_weight = format_weight
        self.prompt_template = prompt_template
        self.invalid_action_hint = invalid_action_hint
        self.use_demonstration = demonstration
        self.lenient_search = lenient_search
        self.seed = seed
        # max_output_tokens=None: whole observations are cut to max_observation_tokens, by the
        # codec (keeping the documents' head and tail, so the closing </information> too).
        self.tools = ToolRegistry([self.search], max_output_tokens=None)
        self._episode: _Episode | None = None
        self._infra_error: Exception | None = None

    # ------------------------------------------------------------------ the tool

    @tool(name="search", timeout_s=120.0)
    async def search(self, query: str) -> str:
        """Search the knowledge corpus and return the top documents.

        Args:
            query: what to look up, in a few words.
        """
        try:
            (documents,) = await self.retriever().search([query], self.topk)
        except RetrieverUnavailableError as e:
            self._infra_error = e  # re-raised by step: a dead server is an ERROR, not a reward of 0
            raise
        return format_documents([d.contents for d in documents])

    def retriever(self) -> Retriever:
        if self.retriever_kind == "http":
            return shared_retriever("http", url=self.retriever_url)
        corpus = self.corpus or str(embedded.ensure_embedded(self.seed) / "corpus.jsonl")
        return shared_retriever("bm25", corpus=corpus)

    # ------------------------------------------------------------------ episodes

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task = _task_from_options(options)
        self._episode = _Episode(task=task, golden_answers=list(task.data["golden_answers"]))
        self._infra_error = None
        await self._warm_up()
        prompt = task.data.get("prompt") or make_prompt(task.data["question"], self.prompt_template)
        return [*self._demonstration(), Message(role="user", content=prompt)], {
            "task_id": task.id,
            "golden_answers": self._episode.golden_answers,
        }

    def _demonstration(self) -> list[Message]:
        if not self.use_demonstration:
            return []
        question = make_prompt(DEMONSTRATION_QUESTION, self.prompt_template)
        turns = [Message(role=role, content=text) for role, text in demonstration_turns(self.topk)]
        return [Message(role="user", content=question), *turns]

    async def _warm_up(self) -> None:
        """Fail before the first generation: load (or build) the index, or reach the server."""
        retriever = await asyncio.to_thread(self.retriever)
        if isinstance(retriever, HTTPRetriever):
            await retriever.check()
        elif isinstance(retriever, BM25Retriever):
            await asyncio.to_thread(lambda: retriever.index)

    async def step(self, action: Message) -> StepResult:
        ep = self._require_episode()
        ep.num_turns += 1
        ep.answer_text += action.content
        ep.transcript += action.content
        parsed = _action_of(action, lenient_search=self.lenient_search)
        is_final_turn = ep.num_turns > self.max_turns
        if parsed.kind == "answer":
            return self._finish(ep, truncated=False)
        if is_final_turn or (ep.num_turns == self.max_turns and not self.use_final_answer_turn):
            return self._finish(ep, truncated=True)  # the final turn never searches (as Search-R1)
        if parsed.kind == "search":
            return await self._search_step(
                ep, parsed.call or _search_call(parsed.content, f"search-{ep.num_turns}")
            )
        ep.num_invalid_actions += 1
        return self._observe(
            ep,
            Message(role="user", content=self.invalid_action_hint),
            num_tool_calls=0,
            num_tool_errors=0,
        )

    async def _search_step(self, ep: _Episode, call: ToolCall) -> StepResult:
        result = await self.tools.call(call)
        if self._infra_error is not None:
            raise self._infra_error
        ep.num_searches += 1
        text = format_observation(result.content)
        message = Message(role="tool", content=text, tool_call_id=call.id, name="search")
        step = self._observe(ep, message, num_tool_calls=1, num_tool_errors=int(result.is_error))
        step.info["query"] = _query_of(call)
        if result.is_error:
            step.info["tool_error_kind"] = result.error_kind
        return step

    def _observe(
        self, ep: _Episode, message: Message, *, num_tool_calls: int, num_tool_errors: int
    ) -> StepResult:
        ep.transcript += message.content
        info = {
            "num_tool_calls": num_tool_calls,
            "num_tool_errors": num_tool_errors,
            "num_turns": ep.num_turns,
        }
        return StepResult(observation=[message], reward=0.0, info=info)

    def _finish(self, ep: _Episode, *, truncated: bool) -> StepResult:
        breakdown = score_response(
            ep.answer_text, ep.transcript, ep.golden_answers, self.format_scores, self.format_weight
        )
        components = {
            **breakdown.to_dict(),
            "searches": ep.num_searches,
            "searched": ep.num_searches > 0,
        }
        info: dict[str, Any] = {
            "num_tool_calls": 0,
            "num_tool_errors": 0,
            "num_turns": ep.num_turns,
            "num_searches": ep.num_searches,
            "num_invalid_actions": ep.num_invalid_actions,
            "answer": breakdown.answer,
            # EM decides pass rate whatever the training reward (em, f1 or format) is.
            "correct": bool(breakdown.em),
            "golden_answers": ep.golden_answers,
            "reward_components": components,
        }
        if truncated:
            info["truncated_reason"] = StatusReason.MAX_TURNS.value
        reward = pick_reward(breakdown, self.reward_kind)  # type: ignore[arg-type]
        return StepResult(
            observation=[], reward=reward, terminated=not truncated, truncated=truncated, info=info
        )

    def _require_episode(self) -> _Episode:
        if self._episode is None:
            raise RuntimeError(
                "SearchR1Env.step() before reset(): call reset(options={'task': task}) first"
            )
        return self._episode

    # ------------------------------------------------------------------ data

    @classmethod
    def load_tasks(cls, split: str, **kwargs: Any) -> list[Task]:
        """The shipped natural-question splits "train", "dev", "test" (written by hand over the
        bundled corpus, see `natural`), or the generated title look-ups "titles-train",
        "titles-dev", "titles-test" (see `embedded`)."""
        if split in natural.SPLITS:
            rows = natural.read_split(split)
        elif split in embedded.TITLE_SPLITS:
            seed = kwargs.get("seed", embedded.DEFAULT_SEED)
            path = Path(embedded.ensure_embedded(seed)) / f"{split.removeprefix('titles-')}.jsonl"
            rows = embedded.read_jsonl(path)
        else:
            names = ", ".join((*natural.SPLITS, *embedded.TITLE_SPLITS))
            raise ValueError(
                f"split={split!r}: search_r1 ships {names}; pass a data file for others"
            )
        return [tasks.task_from_row(row, index=i, split=split) for i, row in enumerate(rows)]

    @classmethod
    def task_from_row(
        cls,
        row: dict[str, Any],
        *,
        index: int,
        input_key: str | None = None,
        label_key: str | None = None,
    ) -> Task:
        return tasks.task_from_row(row, index=index, input_key=input_key, label_key=label_key)


def _task_from_options(options: dict[str, Any] | None) -> Task:
    task = (options or {}).get("task")
    if isinstance(task, dict):
        task = Task(id=str(task.get("id", "task")), data=task.get("data", task))
    if not isinstance(task, Task):
        raise ValueError(
            "SearchR1Env.reset needs options={'task': Task(...)} with data 'question' and 'golden_answers'"
        )
    for key in ("question", "golden_answers"):
        if key not in task.data:
            raise ValueError(
                f"task {task.id!r}: data has no {key!r}; make tasks with SearchR1Env.task_from_row"
            )
    return task


@dataclass(frozen=True)
class _Parsed:
    kind: str | None
    content: str = ""
    call: ToolCall | None = None  # a call the codec parsed, forwarded as written


_OPEN_SEARCH_RE = re.compile(r"\s*<search>(.*?)(?:</\w+>|$)", re.DOTALL)


def _action_of(action: Message, *, lenient_search: bool = False) -> _Parsed:
    """Search-R1's rule on the text first; else a `search` call the codec moved out of it
    (forwarded untouched, so malformed arguments come back as a tool error); else, with
    `lenient_search`, a turn that opens with `<search>` but closes it with another tag or
    not at all searches for the text up to there."""
    parsed = parse_action(action.content)
    if parsed.kind is not None:
        ids = [c.id for c in action.tool_calls if c.name == parsed.kind and c.id]
        call = _search_call(parsed.content, ids[0]) if parsed.kind == "search" and ids else None
        return _Parsed(parsed.kind, parsed.content, call)
    for call in action.tool_calls:
        if call.name == "search":
            return _Parsed("search", _query_of(call), call)
    match = _OPEN_SEARCH_RE.match(action.content) if lenient_search else None
    if match and match.group(1).strip():
        return _Parsed("search", match.group(1).strip())
    return _Parsed(None)


def _search_call(query: str, call_id: str) -> ToolCall:
    return ToolCall(name="search", arguments=json.dumps({"query": query}), id=call_id)


def _query_of(call: ToolCall) -> str:
    try:
        args = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        return str(call.arguments).strip()
    return str(args.get("query", "")).strip() if isinstance(args, dict) else str(args).strip()
