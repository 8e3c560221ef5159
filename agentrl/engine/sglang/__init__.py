"""SGLang's side of the wire: the HTTP client (`SGLangEngine`), its request and response shapes, the
server launcher, and the trainer's end of the weight-update group."""

from agentrl.engine.sglang.client import SGLangEngine

__all__ = ["SGLangEngine"]
