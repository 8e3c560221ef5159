"""agentrl: reinforcement learning for multi-turn, tool-using LLM agents."""

from __future__ import annotations

__version__ = "0.1.0"
