"""SGLang's side of the wire: the HTTP client (`SGLangEngine`, composed of its `SGLangHTTP` plumbing
and its `SGLangWeights` part), its request and response shapes, and the server launcher."""

from agentrl.engine.sglang.client import SGLangEngine

__all__ = ["SGLangEngine"]
