"""Environments bundled with agentrl; each registers through the `agentrl.envs` entry-point group."""
