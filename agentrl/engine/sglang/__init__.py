"""SGLang's side of the wire: the HTTP client (`SGLangEngine`, composed of its `SGLangHTTP` plumbing
and its `SGLangWeights` part), and its request and response shapes; it starts no process
(the servers agentrl launches are `agentrl.deploy`'s)."""

from agentrl.engine.sglang.client import SGLangEngine

__all__ = ["SGLangEngine"]
