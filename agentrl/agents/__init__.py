"""Agents from anywhere: an unmodified OpenAI-client agent (`async def run(task, client)`)
trained token for token through a loopback endpoint bound to each episode."""

from __future__ import annotations

from agentrl.rollout.agent_endpoint.capture import EpisodeCapture, Segment
from agentrl.rollout.agent_endpoint.endpoint import AgentEndpoint
from agentrl.rollout.agent_endpoint.episode import (
    AgentEpisode,
    AgentResult,
    load_agent,
    run_agent_episode,
)

__all__ = [
    "AgentEndpoint",
    "AgentEpisode",
    "AgentResult",
    "EpisodeCapture",
    "Segment",
    "load_agent",
    "run_agent_episode",
]
