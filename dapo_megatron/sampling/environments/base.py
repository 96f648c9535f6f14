"""What an environment of a multi-turn rollout is to the trainer.

An episode answers a prompt in turns: the model writes a turn (the engine's sampled token
ids, and their text), the episode answers with an :class:`Observation` (a tool's output,
say), and the model continues from everything so far, until the episode is done. The
trainer keeps the model's own token ids as sampled and appends the observation's ids
after them; nothing the model wrote is decoded and encoded again (see
``sampling/episodes.py``). Only the model's tokens are trained; an observation stays in
the context and out of the loss.

An environment is a class of :class:`Environment` (registered by name, or named as
``module:Class`` in ``rollout.env``); :meth:`Environment.start` begins one episode of a
prompt, and the episode is called once per model turn. An episode may keep state of its
own between turns (an interpreter's variables); it must not depend on anything but its
prompt and the turns it was given, so that a resumed run replays it exactly.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

from dapo_megatron.data import Prompt


@dataclass(frozen=True)
class Observation:
    """An episode's answer to one model turn."""

    text: Optional[str] = None
    """What the model reads next, tokenised once by the trainer (``token_ids`` instead,
    when the environment tokenises itself); None with ``done`` and nothing to add."""
    token_ids: Optional[tuple[int, ...]] = None
    """The observation as token ids (``text`` is then ignored)."""
    done: bool = False
    """The episode has ended: the model writes no further turn."""
    reward: Optional[float] = None
    """The episode's score, when the environment gives one at its end (otherwise the
    run's ``reward_fn`` scores the whole trajectory's text)."""
    tool_calls: int = 0
    """Tool calls the turn held (for the step's metrics)."""
    tool_errors: int = 0
    """Of which failed: raised, refused, or cut off by a limit."""
    tool_timeouts: int = 0
    """Of which ran out of their time bound."""

    def __post_init__(self) -> None:
        if not self.done and self.text is None and self.token_ids is None:
            raise ValueError("an observation that does not end the episode needs text or token_ids")
        if self.tool_errors > self.tool_calls or self.tool_timeouts > self.tool_errors:
            raise ValueError(
                f"tool_calls={self.tool_calls} >= tool_errors={self.tool_errors} >= "
                f"tool_timeouts={self.tool_timeouts} must hold"
            )


class Episode(abc.ABC):
    """One prompt's episode (see the module docstring)."""

    @abc.abstractmethod
    def step(self, turn_ids: list[int], turn_text: str) -> Observation:
        """The answer to the model's turn ``turn_ids`` (the engine's tokens, as sampled;
        ``turn_text`` their text)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (a process, files); called once it has ended."""


class Environment(abc.ABC):
    """Begins episodes; says where a model turn ends."""

    stop_strings: tuple[str, ...] = ()
    """Text that ends a model turn besides the end-of-sequence token (a tool call's closing
    tag): the engine stops right after it, and the episode answers."""
    concurrent_steps: int = 1
    """How many episodes may answer their turns at once, each in a thread of its own (a
    tool that waits on a process, as ``python`` does); 1: one after another. An episode
    is never called from two threads at once."""

    @abc.abstractmethod
    def start(self, prompt: Prompt) -> Episode:
        """A new episode answering ``prompt``."""

    def describe(self) -> str:
        """What ``dapo-megatron plan`` says of the environment's cost (its processes,
        memory, time); empty when there is nothing to say."""
        return ""


def tagged_call(turn_text: str, opening: str, closing: str) -> Optional[str]:
    """What a turn's call holds between ``opening`` and ``closing`` (``<calc>`` and
    ``</calc>``, say), or None without one. A turn that holds ``closing`` ended there (the
    engine stops at the first, with the token that completes it, which may carry a
    character or two more): the call is what follows the last ``opening`` before it."""
    end = turn_text.find(closing)
    start = turn_text.rfind(opening, 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return turn_text[start + len(opening) : end]
