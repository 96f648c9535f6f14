"""Environments the end-to-end tests name as ``module:Class`` (``rollout.env``), in the demo
tokenizer's characters (digits, ``+``, ``=``, ``Answer: ``, newline)."""

from __future__ import annotations

from dapo_megatron.sampling.environments import Environment, Episode, Observation


class _PlusEpisode(Episode):
    def step(self, turn_ids, turn_text):
        if turn_text.endswith(("+", "=")):
            return Observation(text="7\n", tool_calls=1, tool_errors=int(turn_text.endswith("=")))
        return Observation(done=True)


class PlusCalls(Environment):
    """A turn that ends with ``+`` or ``=`` is a tool call, answered ``7`` and a newline
    (``=``: counted as a failed one); any other turn ends the episode."""

    stop_strings = ("+", "=")

    def start(self, prompt) -> Episode:
        return _PlusEpisode()
