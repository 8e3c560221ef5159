"""Agent episodes: an OpenAI-client agent's chat completions captured token for token through a
loopback endpoint bound to each episode (the public names live in `agentrl.agents`)."""
