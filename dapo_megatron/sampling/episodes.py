"""Multi-turn episodes, token in and token out.

A trajectory is one token sequence after the prompt: each model turn exactly as the
engine sampled it (its ids and their sampling log-probs), and after it the environment's
observation, tokenised once (``tokenizer.encode`` of its text without special tokens) or
given as ids. The next turn is generated from the prompt and everything so far as token
ids; nothing the model wrote is ever decoded and encoded again. Decoding and encoding a
turn does not always give back its ids (a tokenizer merges characters across the point
where one generation stopped and the next began); every trajectory counts the turns
where it would not have (``retokenized_differs``), so a run shows what it avoided.

Only the model's tokens are trained: ``model_mask`` is 1 on them and 0 on observation
tokens, which carry a log-prob of 0.0 (no engine sampled them). Bounds: at most
``max_turns`` model turns, at most ``max_tokens`` tokens after the prompt in all (model
and observation tokens); an episode that reaches either ends there (``finish_reason``
``max_turns`` or ``length``), one whose engine gave up ends ``abort``.

Seeds: every turn of a row samples from :func:`continuation_seed` of the row's seed and
the tokens it holds, so a row's turns never share a seed and a replay samples the same.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from dapo_megatron.config import RolloutConfig
from dapo_megatron.data import Prompt
from dapo_megatron.rollout import routed_experts
from dapo_megatron.rollout.engine import Generation, SamplingParams
from dapo_megatron.rollout.seeds import continuation_seed, sampling_seeds
from dapo_megatron.sampling.environments.base import Environment, Episode, Observation
from dapo_megatron.sampling.environments.registry import make_environment

Generate = Callable[[list[list[int]], SamplingParams], list[Generation]]
"""An engine's generation of one response per row (``RolloutWorkers.generate`` with n 1)."""


@dataclass(frozen=True)
class EpisodeRules:
    """How a run's responses are played as episodes: the environment, the turn bound (the
    token bound is the responses', ``rollout.max_response_length``) and the text put
    around every observation (``rollout.observation_format``)."""

    environment: Environment
    max_turns: int
    framing: tuple[str, str] = ("", "")


def episode_rules(rollout: RolloutConfig, tokenizer) -> Optional[EpisodeRules]:
    """``rollout.env``'s environment (built with ``rollout.env_options``),
    ``rollout.max_turns`` and the observations' framing in ``tokenizer``'s chat template
    (``rollout.observation_format``); None for single-turn responses (``env`` unset)."""
    if rollout.env is None:
        return None
    framing = chat_framing(tokenizer) if rollout.observation_format == "chat" else ("", "")
    return EpisodeRules(make_environment(rollout.env, rollout.env_options), rollout.max_turns, framing)


_TURN, _OBSERVED = "\x00model-turn\x00", "\x00observation\x00"


def chat_framing(tokenizer) -> tuple[str, str]:
    """The text before and after an observation in ``tokenizer``'s chat template: the
    observation as a ``tool`` message after the model's turn as an ``assistant`` message,
    and the next assistant message's start (Qwen2.5: ``<|im_end|>\n<|im_start|>user\n
    <tool_response>\n`` and ``\n</tool_response><|im_end|>\n<|im_start|>assistant\n``).
    ValueError when the tokenizer has no template or the template has no tool messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "rollout.observation_format=chat: the run's tokenizer has no chat template (use 'inline', or a "
            "tokenizer with one)"
        )
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
    try:
        text = tokenizer.apply_chat_template(
            [*messages, {"role": "tool", "content": _OBSERVED}], tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # noqa: BLE001 - templates raise what they like
        raise ValueError(
            f"rollout.observation_format=chat: the chat template cannot render a tool message ({exc})"
        ) from None
    if text.count(_TURN) != 1 or text.count(_OBSERVED) != 1:
        raise ValueError("rollout.observation_format=chat: the chat template does not show a tool message's content")
    after_turn = text.split(_TURN, 1)[1]
    prefix, suffix = after_turn.split(_OBSERVED, 1)
    return prefix, suffix


@dataclass(frozen=True)
class EpisodeStats:
    """What a step's metrics count of one episode."""

    turns: int
    tool_calls: int
    tool_errors: int
    tool_timeouts: int
    observation_tokens: int
    ended_by_max_turns: bool
    retokenized_differs: int


def episode_metrics(stats: list[EpisodeStats], model_tokens: int) -> dict[str, float]:
    """The ``episode/*`` metrics of a step's episodes (``model_tokens``: the tokens their
    model turns hold; ``masked_token_share`` is the observations' share of all tokens
    after the prompts)."""
    n = max(len(stats), 1)
    observed = sum(s.observation_tokens for s in stats)
    response_tokens = model_tokens + observed
    return {
        "episode/turns_mean": sum(s.turns for s in stats) / n,
        "episode/tool_calls": float(sum(s.tool_calls for s in stats)),
        "episode/tool_errors": float(sum(s.tool_errors for s in stats)),
        "episode/tool_timeouts": float(sum(s.tool_timeouts for s in stats)),
        "episode/observation_tokens": float(observed),
        "episode/masked_token_share": observed / max(response_tokens, 1),
        "episode/ended_by_max_turns": float(sum(s.ended_by_max_turns for s in stats)),
        "episode/retokenized_turns": float(sum(s.retokenized_differs for s in stats)),
    }


@dataclass
class Trajectory:
    """One episode, as the trainer trains on it (see the module docstring)."""

    prompt_index: int
    """Which prompt of the request it answers."""
    token_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model turns and observations, in order."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's sampling log-prob of each model token; 0.0 at observation tokens."""
    model_mask: list[int] = field(default_factory=list)
    """1: a token the model sampled (trained); 0: an observation's (context only)."""
    turns: int = 0
    """Model turns generated."""
    turn_ends: list[int] = field(default_factory=list)
    """Where each model turn ends in ``token_ids`` (what a replay of the episode reads)."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    retokenized_differs: int = 0
    """Turns whose ids decoding and encoding would have changed."""
    finish_reason: Optional[str] = None
    """``stop`` (the episode ended), ``length``, ``max_turns`` or ``abort``; None while running."""
    reward: Optional[float] = None
    """The environment's score of the episode, when it gives one."""
    weight_version: int = -1
    """The oldest weight version that sampled one of its turns."""
    routed_experts: Optional[np.ndarray] = None
    """With routing records (``model.routing_replay``): the prompt's and every token's but
    the last, as routed when the turn they belong to was sampled (``rollout/routed_experts.py``)."""

    @property
    def observation_tokens(self) -> int:
        return len(self.model_mask) - sum(self.model_mask)

    @property
    def stats(self) -> EpisodeStats:
        return EpisodeStats(
            self.turns,
            self.tool_calls,
            self.tool_errors,
            self.tool_timeouts,
            self.observation_tokens,
            self.finish_reason == "max_turns",
            self.retokenized_differs,
        )


def run_episodes(
    generate: Generate,
    prompts: list[Prompt],
    n: int,
    params: SamplingParams,
    environment: Environment,
    tokenizer,
    *,
    max_turns: int,
    max_tokens: int,
    framing: tuple[str, str] = ("", ""),
) -> list[Trajectory]:
    """``n`` episodes of each prompt (prompt-major, as engines return responses), played
        to their end (see the module docstring). ``params.row_seeds`` (one per episode) seed
        the rows (without them, :func:`sampling_seeds` of ``params.seed``; unseeded without
    either); ``params.max_new_tokens`` bounds one turn. ``framing``: the text put before
    and after every observation (:func:`chat_framing`), tokenised with it, out of the loss."""
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"max_turns={max_turns} and max_tokens={max_tokens} must be at least 1")
    rows = len(prompts) * n
    seeds = params.row_seeds
    if seeds is None and params.seed is not None:
        seeds = sampling_seeds(params.seed, 0, 0, len(prompts), n)
    if seeds is not None and len(seeds) != rows:
        raise ValueError(f"{len(seeds)} row seeds for {rows} episodes")
    stop = (*params.stop_strings, *environment.stop_strings)
    trajectories = [Trajectory(row // n) for row in range(rows)]
    episodes: list[Optional[Episode]] = [None] * rows
    try:
        for row in range(rows):
            episodes[row] = environment.start(prompts[row // n])
        active = list(range(rows))
        while active:
            turn = [trajectories[row] for row in active]
            # Each row's turn may fill what is left of its budget; the request asks for the
            # largest, and a row's tokens beyond its own are dropped (sampling more after
            # them does not change them).
            budgets = [min(params.max_new_tokens, max_tokens - len(t.token_ids)) for t in turn]
            request = replace(
                params,
                seed=None,
                stop_strings=stop,
                row_seeds=None
                if seeds is None
                else tuple(continuation_seed(seeds[row], len(t.token_ids)) for row, t in zip(active, turn)),
                max_new_tokens=max(budgets),
            )
            contexts = [list(prompts[t.prompt_index].token_ids) + t.token_ids for t in turn]
            played = []
            for row, budget, context, generation in zip(active, budgets, contexts, generate(contexts, request)):
                if len(generation.token_ids) > budget:
                    generation = replace(
                        generation,
                        token_ids=generation.token_ids[:budget],
                        log_probs=generation.log_probs[:budget],
                        finish_reason="length",
                        routed_experts=routed_experts.cut(generation.routed_experts, len(context) + budget - 1),
                    )
                played.append((trajectories[row], episodes[row], generation))
            play_turns(played, environment, tokenizer, stop, max_turns, max_tokens, framing)
            for row in active:
                if trajectories[row].finish_reason is not None:
                    episode, episodes[row] = episodes[row], None
                    episode.close()
            active = [row for row in active if trajectories[row].finish_reason is None]
    finally:
        for episode in episodes:
            if episode is not None:
                episode.close()
    return trajectories


def play_turns(
    played: list[tuple[Trajectory, Episode, Generation]],
    environment: Environment,
    tokenizer,
    stop_strings: tuple[str, ...],
    max_turns: int,
    max_tokens: int,
    framing: tuple[str, str],
) -> None:
    """Each episode's model turn (``generation``, as the engine sampled it) appended to its
    trajectory and, unless the turn ends the episode, answered by the episode (the answers
    ``environment.concurrent_steps`` at once) and the answer appended: a trajectory whose
    ``finish_reason`` is still None goes on with another turn. Rounds and streamed
    generation both play turns this way."""
    asked = []
    for trajectory, episode, generation in played:
        text = _append_turn(trajectory, generation, tokenizer)
        if text is not None:
            asked.append((trajectory, episode, list(generation.token_ids), text))
    observations = environment_answers(environment, [(episode, ids, text) for _, episode, ids, text in asked])
    for (trajectory, _, _, text), observation in zip(asked, observations):
        _take_observation(trajectory, observation, text, tokenizer, stop_strings, max_turns, max_tokens, framing)


def _append_turn(trajectory: Trajectory, generation: Generation, tokenizer) -> Optional[str]:
    """Append one model turn; its text when the episode answers it, None when the turn
    ended the episode (the engine gave up, or the budget ran out mid-turn)."""
    ids = list(generation.token_ids)
    trajectory.token_ids += ids
    trajectory.log_probs += list(generation.log_probs)
    trajectory.model_mask += [1] * len(ids)
    trajectory.routed_experts = routed_experts.extended(trajectory.routed_experts, generation.routed_experts)
    trajectory.turn_ends.append(len(trajectory.token_ids))
    trajectory.turns += 1
    if trajectory.weight_version < 0 or 0 <= generation.weight_version < trajectory.weight_version:
        trajectory.weight_version = generation.weight_version
    if tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids:
        trajectory.retokenized_differs += 1
    if generation.finish_reason in ("abort", "length"):
        trajectory.finish_reason = generation.finish_reason
        return None
    return tokenizer.decode(ids, skip_special_tokens=True)


def environment_answers(environment: Environment, asked: list[tuple[Episode, list[int], str]]) -> list[Observation]:
    """Each episode's answer to its turn, ``environment.concurrent_steps`` at once."""
    if environment.concurrent_steps <= 1 or len(asked) <= 1:
        return [episode.step(ids, text) for episode, ids, text in asked]
    with ThreadPoolExecutor(min(environment.concurrent_steps, len(asked)), thread_name_prefix="episode") as pool:
        return list(pool.map(lambda call: call[0].step(call[1], call[2]), asked))


def _take_observation(
    trajectory: Trajectory,
    observation: Observation,
    text: str,
    tokenizer,
    stop_strings: tuple[str, ...],
    max_turns: int,
    max_tokens: int,
    framing: tuple[str, str],
) -> None:
    """Count the episode's answer to a turn of ``text`` and, unless the episode ends,
    append it. A turn that stopped on a token (end of sequence) ends the episode whatever
    the environment answers; one that stopped on a stop string (the engine stops at the
    first) is a tool call the observation answers."""
    trajectory.tool_calls += observation.tool_calls
    trajectory.tool_errors += observation.tool_errors
    trajectory.tool_timeouts += observation.tool_timeouts
    if observation.reward is not None:
        trajectory.reward = observation.reward
    ended_on_eos = not any(stop in text for stop in stop_strings)
    if observation.done or ended_on_eos:
        trajectory.finish_reason = "stop"
    elif len(trajectory.token_ids) >= max_tokens:
        trajectory.finish_reason = "length"
    elif trajectory.turns >= max_turns:
        trajectory.finish_reason = "max_turns"
    else:
        _append_observation(trajectory, observation, tokenizer, max_tokens, framing)


def _append_observation(
    trajectory: Trajectory, observation: Observation, tokenizer, max_tokens: int, framing: tuple[str, str]
) -> None:
    """The observation's ids after the turn, in its framing (cut at ``max_tokens``, which
    ends the episode)."""
    before, after = framing
    if observation.token_ids is not None:
        ids = list(observation.token_ids)
        bad = [token for token in ids if not 0 <= token < len(tokenizer)]
        if bad:
            raise ValueError(
                f"the environment's observation holds token ids {bad[:5]} outside the tokenizer's {len(tokenizer)}"
            )
        if before or after:
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False) if text else []  # noqa: E731
            ids = encode(before) + ids + encode(after)
    else:
        ids = tokenizer.encode(before + observation.text + after, add_special_tokens=False)
    room = max_tokens - len(trajectory.token_ids)
    trajectory.token_ids += ids[:room]
    trajectory.log_probs += [0.0] * len(ids[:room])
    trajectory.model_mask += [0] * len(ids[:room])
    if len(ids) >= room:
        trajectory.finish_reason = "length"
