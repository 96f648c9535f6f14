"""Environments of multi-turn, tool-using rollouts: the interface (``base``), the built-in
environments, and resolving ``rollout.env``'s name (``registry``)."""

from dapo_megatron.sampling.environments.base import Environment, Episode, Observation
from dapo_megatron.sampling.environments.registry import (
    available_environments,
    make_environment,
    resolve_environment,
)

__all__ = ["Environment", "Episode", "Observation", "available_environments", "make_environment", "resolve_environment"]
