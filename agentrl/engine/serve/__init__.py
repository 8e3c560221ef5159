"""`agentrl serve`: a LocalEngine behind SGLang's native HTTP API plus OpenAI-compatible routes."""

from agentrl.engine.serve.app import create_app, serve

__all__ = ["create_app", "serve"]
