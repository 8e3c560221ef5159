"""Rollout: the chat codec, token-exact episodes and groups of them, recorded as Trajectories."""

from __future__ import annotations

from agentrl.rollout.codec import ChatCodec, CodecCheckError
from agentrl.rollout.codec_check import CheckReport, check_codec
from agentrl.rollout.episode import run_episode
from agentrl.rollout.group import RolloutRunner, build_runner, episode_seed
from agentrl.types import Trajectory, Turn, read_jsonl, write_jsonl

__all__ = [
    "ChatCodec",
    "CheckReport",
    "CodecCheckError",
    "RolloutRunner",
    "Trajectory",
    "Turn",
    "build_runner",
    "check_codec",
    "episode_seed",
    "read_jsonl",
    "run_episode",
    "write_jsonl",
]
