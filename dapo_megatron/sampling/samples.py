"""From generated responses to the actor's batch: pure data plumbing for the trainer.

The trainer keeps every response together with the prompt it answers (its id, answer and
data source), its reward and its engine log-probs, as a :class:`Sample`. This module turns
a round of generations into samples, scores them with the soft overlong punishment, and
assembles the kept groups into a :class:`PolicyBatch` with advantages computed *by prompt
identity*, never by position. No Ray, no ranks: it is tested on its own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dapo_megatron.actor.batch import PolicyBatch
from dapo_megatron.algo import group_advantages_by_id, overlong_filter_mask, overlong_penalty
from dapo_megatron.algo.rewards import RewardResult
from dapo_megatron.config import AlgorithmConfig
from dapo_megatron.data import Prompt
from dapo_megatron.rollout.engine import Generation
from dapo_megatron.sampling.episodes import EpisodeStats, Trajectory


@dataclass
class Sample:
    """One response and everything the step needs to know about it."""

    group_id: tuple[int, int]
    """``(round, position of the prompt in the round)``: the identity of its group."""
    prompt: Prompt
    """The prompt it answers."""
    response_ids: list[int]
    """The response's tokens."""
    engine_log_probs: list[float]
    """The engine's sampling log-prob of each response token."""
    finish_reason: str
    """``stop``, ``length`` (truncated) or ``abort`` (the engine gave up on it)."""
    text: str
    """The decoded response."""
    correct: bool = False
    """Whether the reward function found the right answer."""
    score: float = 0.0
    """The reward function's score."""
    overlong_penalty: float = 0.0
    """The soft overlong punishment added to the score."""
    timed_out: bool = False
    """The reward call exceeded its time bound."""
    reward_error: bool = False
    """The reward function raised."""
    prediction: Optional[str] = None
    """The answer the reward function read from the response, when it reports one."""
    policy_version: int = 0
    """The actor step whose weights the engine sampled with (0: the initial weights), as
    the engine reported it; the trainer refuses to train on a sample more than one step
    behind the actor (with streamed generation's carried groups and partial responses,
    ``rollout.max_staleness``): with ``token_versions``, the oldest of them."""
    token_versions: Optional[list[int]] = None
    """Streamed generation: the policy version that sampled each response token (a partial
    rollout continued under newer weights holds several); None: all ``policy_version``."""
    model_mask: Optional[list[int]] = None
    """Multi-turn episodes (``sampling/episodes.py``): 1 at each response token the model
    sampled, 0 at an observation's (in the context, out of the loss and its token count);
    None: the model sampled every response token."""
    episode: Optional[EpisodeStats] = None
    """Multi-turn episodes: what the step's metrics count of it."""
    environment_reward: Optional[float] = None
    """Multi-turn episodes: the environment's score, when it gave one (it replaces the
    reward function's)."""
    routed_experts: Optional[np.ndarray] = None
    """With ``model.routing_replay``: the experts the engine routed the prompt's and the
    response's tokens to (``[positions, moe_layers, k]``, ``rollout/routed_experts.py``)."""

    @property
    def reward(self) -> float:
        """The reward the advantage uses: score plus the overlong punishment."""
        return self.score + self.overlong_penalty


def samples_from_generations(
    prompts: list[Prompt], generations: list[Generation], round_index: int, tokenizer
) -> list[Sample]:
    """One sample per generation, in the engines' order (``n`` per prompt)."""
    samples = []
    for generation in generations:
        text = generation.text
        if text is None:
            text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        samples.append(
            Sample(
                group_id=(round_index, generation.prompt_index),
                prompt=prompts[generation.prompt_index],
                response_ids=list(generation.token_ids),
                engine_log_probs=list(generation.log_probs),
                finish_reason=generation.finish_reason,
                text=text,
                policy_version=generation.weight_version,
                routed_experts=generation.routed_experts,
            )
        )
    return samples


def samples_from_trajectories(
    prompts: list[Prompt], trajectories: list[Trajectory], round_index: int, tokenizer
) -> list[Sample]:
    """One sample per episode: its tokens after the prompt are the response (model turns
    and observations), ``model_mask`` says which the model sampled; its text (what the
    reward function reads) is their decoding. An episode ended by ``max_turns`` finished
    as ``stop`` (it was not cut by the length bound)."""
    return [
        Sample(
            group_id=(round_index, t.prompt_index),
            prompt=prompts[t.prompt_index],
            response_ids=list(t.token_ids),
            engine_log_probs=list(t.log_probs),
            finish_reason="stop" if t.finish_reason == "max_turns" else t.finish_reason,
            text=tokenizer.decode(t.token_ids, skip_special_tokens=True),
            policy_version=t.weight_version,
            model_mask=list(t.model_mask),
            episode=t.stats,
            environment_reward=t.reward,
            routed_experts=t.routed_experts,
        )
        for t in trajectories
    ]


def without_routing(group: list[Sample]) -> list[Sample]:
    """``group`` with its routing records let go: a group that is not trained is kept for
    the rollout records only, which do not hold them (they are the largest part of a
    sample at scale: ``moe_layers x k`` bytes a token)."""
    for sample in group:
        sample.routed_experts = None
    return group


def drop_aborted_groups(samples: list[Sample]) -> tuple[list[Sample], int]:
    """The samples of the groups in which no response was aborted by the engine (an
    aborted response has no reward to learn from, and a group without it would get
    advantages of a different group); and how many responses were aborted."""
    aborted_groups = {s.group_id for s in samples if s.finish_reason == "abort"}
    kept = [s for s in samples if s.group_id not in aborted_groups]
    return kept, sum(s.finish_reason == "abort" for s in samples)


def reward_results(rewards, samples: list[Sample]) -> list[RewardResult]:
    """Each sample's reward: the environment's score of an episode that has one, else the
    reward pool's (``rewards.score``) of its text."""
    unscored = [s for s in samples if s.environment_reward is None]
    scored = iter(rewards.score([s.text for s in unscored], [s.prompt.ground_truth for s in unscored]))
    return [
        next(scored)
        if s.environment_reward is None
        else RewardResult(s.environment_reward, s.environment_reward > 0, None)
        for s in samples
    ]


def apply_rewards(
    samples: list[Sample], results: list[RewardResult], algorithm: AlgorithmConfig, max_response_length: int
) -> None:
    """Store each sample's reward, with the soft overlong punishment when it is enabled."""
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    penalties = torch.zeros(len(samples))
    if algorithm.overlong_buffer_enable and samples:
        penalties = overlong_penalty(
            lengths, max_response_length, algorithm.overlong_buffer_len, algorithm.overlong_penalty_factor
        )
    for sample, result, penalty in zip(samples, results, penalties.tolist()):
        sample.correct, sample.score = result.correct, result.score
        sample.timed_out, sample.reward_error = result.timed_out, result.error is not None
        sample.overlong_penalty = penalty
        sample.prediction = result.prediction


def build_policy_batch(samples: list[Sample], algorithm: AlgorithmConfig) -> PolicyBatch:
    """The actor's batch: prompt + response tokens, advantages by group id, loss mask.

    Rows keep the samples' order (groups consecutive, so a mini-batch holds whole
    groups); the advantages do not depend on it.
    """
    prompt_lengths = torch.tensor([len(s.prompt.token_ids) for s in samples])
    response_lengths = torch.tensor([len(s.response_ids) for s in samples])
    width = int((prompt_lengths + response_lengths).max())
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = list(sample.prompt.token_ids) + sample.response_ids
        tokens[row, : len(ids)] = torch.tensor(ids)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    advantages = group_advantages_by_id(rewards, [s.group_id for s in samples], algorithm.advantage_eps)
    batch = PolicyBatch(tokens, prompt_lengths, response_lengths, advantages=advantages.float())
    if any(s.model_mask is not None for s in samples):
        loss_mask = batch.response_mask()
        for row, sample in enumerate(samples):
            if sample.model_mask is not None:
                start = len(sample.prompt.token_ids)
                loss_mask[row, start : start + len(sample.model_mask)] = torch.tensor(sample.model_mask)
        batch.loss_mask = loss_mask
    if algorithm.overlong_filter:
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        batch.loss_mask = overlong_filter_mask(batch.response_mask(), truncated)
    records = [s.routed_experts for s in samples]
    if any(record is not None for record in records):
        batch.routed_experts, batch.routed_lengths = routing_grid(records, width)
    return batch


def mask_unreplayed_loss_tokens(batch: PolicyBatch) -> int:
    """Rollout routing replay: take out of the loss every loss token whose distribution
    the actor would compute through a position the routing record does not cover (its
    routers there take stand-in experts): a row whose engine answer carried no record, or
    one cut short. A full record covers every position that predicts a loss token, and
    nothing is taken out. How many loss tokens were."""
    if batch.routed_experts is None:
        return 0
    positions = torch.arange(batch.tokens.shape[1])
    # The token at t is predicted from positions 0..t-1: routed when t - 1 < the record's length.
    outside = positions[None, :] > batch.routed_lengths[:, None]
    mask = batch.response_mask()
    dropped = int((mask * outside).sum())
    if dropped:
        batch.loss_mask = mask * ~outside
    return dropped


def routing_grid(records: list[Optional[np.ndarray]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' routing records on the token grid (``[batch, width, moe_layers, k]``,
    zeros past each record) and how many positions each covers (0 for a sample without)."""
    first = next(record for record in records if record is not None)
    grid = torch.zeros((len(records), width, *first.shape[1:]), dtype=torch.from_numpy(first[:0]).dtype)
    lengths = torch.zeros(len(records), dtype=torch.long)
    for row, record in enumerate(records):
        if record is not None:
            used = min(len(record), width)
            grid[row, :used] = torch.from_numpy(record[:used])
            lengths[row] = used
    return grid, lengths


def engine_log_prob_grid(samples: list[Sample], batch: PolicyBatch) -> torch.Tensor:
    """``[batch, seq]`` engine log-probs on the label grid (zero elsewhere)."""
    grid = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        start = len(sample.prompt.token_ids)
        grid[row, start : start + len(sample.engine_log_probs)] = torch.tensor(sample.engine_log_probs)
    return grid


def response_metrics(samples: list[Sample], max_response_length: int, prefix: str = "") -> dict[str, float]:
    """Reward, accuracy and response-length statistics of ``samples``."""
    n = max(len(samples), 1)
    lengths = [len(s.response_ids) for s in samples] or [0]
    return {
        f"{prefix}reward/score_mean": sum(s.reward for s in samples) / n,
        f"{prefix}reward/accuracy": sum(s.correct for s in samples) / n,
        f"{prefix}reward/overlong_penalty_mean": sum(s.overlong_penalty for s in samples) / n,
        f"{prefix}reward/timeouts": float(sum(s.timed_out for s in samples)),
        f"{prefix}reward/errors": float(sum(s.reward_error for s in samples)),
        f"{prefix}response/length_mean": sum(lengths) / len(lengths),
        f"{prefix}response/length_max": float(max(lengths)),
        f"{prefix}response/length_min": float(min(lengths)),
        f"{prefix}response/clip_ratio": sum(s.finish_reason == "length" for s in samples) / n,
    }


def problem_results(samples: list[Sample]) -> list[dict]:
    """One record per problem (in prompt order): its k outcomes, accuracy and answers."""
    problems: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        problems[sample.prompt.prompt_id].append(sample)
    records = []
    for prompt_id in sorted(problems):
        attempts = problems[prompt_id]
        prompt = attempts[0].prompt
        correct = [s.correct for s in attempts]
        records.append(
            {
                "prompt_id": prompt_id,
                "data_source": prompt.data_source,
                "ground_truth": prompt.ground_truth,
                "k": len(attempts),
                "num_correct": sum(correct),
                "accuracy": sum(correct) / len(attempts),
                "solved": any(correct),
                "predictions": [s.prediction for s in attempts],
                "response_lengths": [len(s.response_ids) for s in attempts],
                "truncated": sum(s.finish_reason == "length" for s in attempts),
                "prompt": prompt.text,
            }
        )
    return records


def validation_metrics(samples: list[Sample], num_samples: int) -> dict[str, float]:
    """avg@k (mean accuracy over all k samples of every problem) and pass@k (a problem
    solved by at least one of its k samples), overall and per data source."""
    by_source: dict[Optional[str], dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for sample in samples:
        for source in (None, sample.prompt.data_source):
            by_source[source][sample.prompt.prompt_id].append(sample.correct)
    metrics: dict[str, float] = {}
    for source, problems in by_source.items():
        name = "val" if source is None else f"val/{source}"
        attempts = [c for outcomes in problems.values() for c in outcomes]
        metrics[f"{name}/accuracy"] = sum(attempts) / max(len(attempts), 1)
        metrics[f"{name}/pass_at_k"] = sum(any(o) for o in problems.values()) / max(len(problems), 1)
        metrics[f"{name}/num_problems"] = float(len(problems))
    metrics["val/k"] = float(num_samples)
    lengths = [len(s.response_ids) for s in samples] or [0]
    metrics["val/response_length_mean"] = sum(lengths) / len(lengths)
    return metrics


def save_samples(path, samples: list[Sample], extra: dict) -> None:
    """Write ``samples`` (and ``extra``: plain numbers and strings) to ``path`` in a binary
    format: token ids and log-probs as flat tensors with their lengths, each prompt once,
    the per-sample numbers as tensors, the strings as lists. Read back bitwise by
    :func:`load_samples` (``torch.load`` with ``weights_only``: no code is unpickled)."""
    torch.save(samples_record(samples, extra), path)


def samples_record(samples: list[Sample], extra: dict) -> dict:
    """The record :func:`save_samples` writes (tensors, lists, numbers and strings only):
    what a batch needs to be trained as it would have been, multi-turn episodes' model
    masks included (their metrics were logged when they were generated, so their episode
    statistics are not kept)."""
    prompts = {s.prompt.prompt_id: s.prompt for s in samples}

    def flat(sequences, dtype):
        lengths = torch.tensor([len(x) for x in sequences], dtype=torch.int64)
        values = torch.tensor([v for x in sequences for v in x], dtype=dtype)
        return values, lengths

    response_ids, response_lengths = flat([s.response_ids for s in samples], torch.int64)
    # float64 keeps each log-prob exactly as the engine reported it (a Python float).
    log_probs, _ = flat([s.engine_log_probs for s in samples], torch.float64)
    prompt_ids, prompt_lengths = flat([p.token_ids for p in prompts.values()], torch.int64)
    record = {
        "format": 1,
        "extra": extra,
        "prompts": {
            "prompt_id": list(prompts),
            "token_ids": prompt_ids,
            "lengths": prompt_lengths,
            **{key: [getattr(p, key) for p in prompts.values()] for key in ("ground_truth", "data_source", "text")},
        },
        "response_ids": response_ids,
        "response_lengths": response_lengths,
        "engine_log_probs": log_probs,
        "group_id": torch.tensor([list(s.group_id) for s in samples], dtype=torch.int64).reshape(-1, 2),
        "prompt_id": torch.tensor([s.prompt.prompt_id for s in samples], dtype=torch.int64),
        **{key: torch.tensor([getattr(s, key) for s in samples], dtype=torch.float64) for key in _FLOAT_FIELDS},
        **{key: torch.tensor([getattr(s, key) for s in samples], dtype=torch.int64) for key in _INT_FIELDS},
        **{key: [getattr(s, key) for s in samples] for key in _STR_FIELDS},
    }
    for key, dtype in _PER_TOKEN_FIELDS.items():
        if any(getattr(s, key) is not None for s in samples):
            record[key] = [
                None if getattr(s, key) is None else torch.tensor(getattr(s, key), dtype=dtype) for s in samples
            ]
    if any(s.routed_experts is not None for s in samples):
        record["routed_experts"] = [
            None if s.routed_experts is None else torch.from_numpy(s.routed_experts) for s in samples
        ]
    return record


_FLOAT_FIELDS = ("score", "overlong_penalty")
_INT_FIELDS = ("correct", "timed_out", "reward_error", "policy_version")
_STR_FIELDS = ("finish_reason", "text", "prediction")
_PER_TOKEN_FIELDS = {"token_versions": torch.int64, "model_mask": torch.int8}
"""Optional per-token lists of a sample (streamed versions; multi-turn episodes' model
mask, what the loss trains), kept only when a sample of the batch has one."""


def load_samples(path) -> tuple[list[Sample], dict]:
    """The samples and ``extra`` that :func:`save_samples` wrote to ``path``."""
    return samples_from_record(torch.load(path, weights_only=True), path)


def samples_from_record(record: dict, path="the record") -> tuple[list[Sample], dict]:
    """The samples and ``extra`` of a :func:`samples_record`."""
    if record.get("format") != 1:
        raise ValueError(f"{path}: not a batch of samples written by this version (format {record.get('format')})")
    p = record["prompts"]
    prompts, start = {}, 0
    for index, (prompt_id, length) in enumerate(zip(p["prompt_id"], p["lengths"].tolist())):
        token_ids = tuple(p["token_ids"][start : start + length].tolist())
        start += length
        prompts[prompt_id] = Prompt(
            prompt_id, token_ids, p["ground_truth"][index], p["data_source"][index], p["text"][index]
        )
    samples, start = [], 0
    for i, length in enumerate(record["response_lengths"].tolist()):
        samples.append(
            Sample(
                group_id=tuple(record["group_id"][i].tolist()),
                prompt=prompts[int(record["prompt_id"][i])],
                response_ids=record["response_ids"][start : start + length].tolist(),
                engine_log_probs=record["engine_log_probs"][start : start + length].tolist(),
                **{key: record[key][i] for key in _STR_FIELDS},
                **{key: float(record[key][i]) for key in _FLOAT_FIELDS},
                **{key: int(record[key][i]) for key in _INT_FIELDS if key == "policy_version"},
                **{key: bool(record[key][i]) for key in _INT_FIELDS if key != "policy_version"},
            )
        )
        for key in _PER_TOKEN_FIELDS:
            values = record[key][i] if key in record else None
            setattr(samples[-1], key, None if values is None else values.tolist())
        if "routed_experts" in record:
            routed = record["routed_experts"][i]
            samples[-1].routed_experts = None if routed is None else routed.numpy()
        start += length
    return samples, record["extra"]
