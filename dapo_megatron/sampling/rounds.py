"""Sampling in rounds: draw ``gen_batch_size`` prompts, generate ``n`` responses each on
every engine at once, score them, and let dynamic sampling keep the groups whose answers
disagree, round after round until ``train_batch_size`` groups are kept.

:class:`RoundSampler` and the streamed :class:`~dapo_megatron.sampling.streaming.StreamingSampler`
are the two ways a step collects its batch; both answer ``collect(step, version, times)``
and keep what a checkpoint needs in ``state_dict`` (rounds keep nothing: every round's
seeds derive from (step, round), and dynamic sampling drops its surplus at the end of a
step). :func:`make_sampler` picks one from ``rollout.streaming``. What a sampler is given
(three sections of the run's config, not all of it) is :class:`~dapo_megatron.sampling.sampler.Sampler`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from dapo_megatron.algo import DynamicSamplingAccumulator
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.config import AlgorithmConfig, DataConfig, RolloutConfig
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.seeds import sampling_seeds
from dapo_megatron.runtime.measure import timed
from dapo_megatron.sampling.episodes import EpisodeRules, episode_metrics, run_episodes
from dapo_megatron.sampling.sampler import Sampler
from dapo_megatron.sampling.samples import (
    Sample,
    apply_rewards,
    drop_aborted_groups,
    response_metrics,
    reward_results,
    samples_from_generations,
    samples_from_trajectories,
    without_routing,
)
from dapo_megatron.sampling.streaming import StreamingSampler


def training_sampling(rollout: RolloutConfig, tokenizer, routed_experts: bool = False) -> SamplingParams:
    """``rollout.*``: the sampling of training rollouts (stopping at the tokenizer's EOS);
    ``routed_experts``: with each token's experts (``model.routing_replay``)."""
    r = rollout
    return SamplingParams(
        r.temperature,
        r.top_p,
        r.top_k,
        r.max_response_length,
        (tokenizer.eos_token_id,),
        return_routed_experts=routed_experts,
    )


def round_sampling(
    sampling: SamplingParams, seed: int, step: int, round_index: int, num_prompts: int, n: int
) -> SamplingParams:
    """``sampling`` with a seed of its own for every response row of generation round
    ``round_index`` of ``step`` (see :func:`sampling_seeds`)."""
    return replace(sampling, seed=None, row_seeds=sampling_seeds(seed, step, round_index, num_prompts, n))


def generate_and_score(
    engines: RolloutWorkers,
    rewards: RewardPool,
    prompts: list,
    params: SamplingParams,
    n: int,
    round_index: int,
    algorithm: AlgorithmConfig,
    tokenizer,
    times: dict[str, float],
    episodes: Optional[EpisodeRules] = None,
) -> list[Sample]:
    """``n`` responses per prompt, scored with ``algorithm``'s overlong punishment (at
    ``params.max_new_tokens``, the response length sampled to); the seconds of both go
    to ``times['generate']`` and ``times['reward']``. With ``episodes``, each response is
    a multi-turn episode (``sampling/episodes.py``), its tool calls counted in the
    generation's time."""
    with timed(times, "generate"):
        if episodes is None:
            generations = engines.generate([list(p.token_ids) for p in prompts], params, n)
        else:
            trajectories = run_episodes(
                lambda contexts, turn: engines.generate(contexts, turn, 1),
                prompts,
                n,
                params,
                episodes.environment,
                tokenizer,
                max_turns=episodes.max_turns,
                max_tokens=params.max_new_tokens,
                framing=episodes.framing,
            )
    if episodes is None:
        samples = samples_from_generations(prompts, generations, round_index, tokenizer)
    else:
        samples = samples_from_trajectories(prompts, trajectories, round_index, tokenizer)
    with timed(times, "reward"):
        apply_rewards(samples, reward_results(rewards, samples), algorithm, params.max_new_tokens)
    return samples


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """``samples`` by group, in the order the groups first appear."""
    groups: dict = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return list(groups.values())


class RoundSampler(Sampler):
    """Rounds of generation and scoring until dynamic sampling holds the batch (see the
    module docstring); given what every :class:`~dapo_megatron.sampling.sampler.Sampler` is."""

    def collect(self, step: int, version: int, times: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """Step ``step``'s kept samples (groups consecutive) and the rollout's metrics: rounds
        of generation and scoring until dynamic sampling holds ``train_batch_size`` groups
        (or fails after ``max_num_gen_batches`` rounds, naming the knobs). The engines'
        weights are ``version`` (each sample carries the version its engine reports)."""
        r, a, d = self.rollout, self.algorithm, self.data
        accumulator = DynamicSamplingAccumulator(
            d.train_batch_size, r.n_samples_per_prompt, a.max_num_gen_batches, filter_groups=a.dynamic_sampling
        )
        generated_tokens = all_equal = groups = timeouts = errors = aborted = 0
        episodes: list = []
        dropped: list[tuple[list[Sample], str]] = []
        round_index = 0
        while not accumulator.is_full:
            prompts = self.loader.next_batch(d.gen_batch_size or d.train_batch_size)
            params = round_sampling(self.sampling, r.seed, step, round_index, len(prompts), r.n_samples_per_prompt)
            samples = generate_and_score(
                self.engines,
                self.rewards,
                prompts,
                params,
                r.n_samples_per_prompt,
                round_index,
                a,
                self.tokenizer,
                times,
                self.episodes,
            )
            generated_tokens += sum(len(s.response_ids) if s.model_mask is None else sum(s.model_mask) for s in samples)
            episodes += [s.episode for s in samples if s.episode is not None]
            dropped += [
                (without_routing(group), "aborted")
                for group in _groups(samples)
                if any(s.finish_reason == "abort" for s in group)
            ]
            samples, round_aborted = drop_aborted_groups(samples)
            aborted += round_aborted
            timeouts += sum(s.timed_out for s in samples)
            errors += sum(s.reward_error for s in samples)
            round_groups = _groups(samples)
            equal = [group for group in round_groups if len({s.correct for s in group}) == 1]
            groups += len(round_groups)
            all_equal += len(equal)
            if a.dynamic_sampling:
                dropped += [
                    (without_routing(group), "all_right" if group[0].correct else "all_wrong") for group in equal
                ]
            round_index += 1
            accumulator.add(samples, [float(s.correct) for s in samples])
        kept, _, sampling_metrics = accumulator.take()
        self.dropped[step] = dropped
        metrics = {
            **response_metrics(kept, r.max_response_length),
            # Every reward call of the step counts, also those whose groups were dropped.
            "reward/timeouts": float(timeouts),
            "reward/errors": float(errors),
            "rollout/aborted_responses": float(aborted),
            **{f"dynamic_sampling/{k}": v for k, v in sampling_metrics.items()},
            "dynamic_sampling/batch_groups": len(kept) / r.n_samples_per_prompt,
            "dynamic_sampling/all_equal_share": all_equal / max(groups, 1),
            "throughput/generate_tokens_per_s": generated_tokens / max(times["generate"], 1e-9),
            "throughput/reward_responses_per_s": groups * r.n_samples_per_prompt / max(times["reward"], 1e-9),
            "data/epoch": float(self.loader.epoch),
        }
        if self.episodes is not None:  # every episode of the step, also those whose groups were dropped
            metrics.update(episode_metrics(episodes, generated_tokens))
        return kept, metrics

    def state_dict(self) -> None:
        """Nothing to keep between steps."""
        return None

    def load_state_dict(self, state: None) -> None:
        """Nothing to restore."""


def make_sampler(*parts, rollout: RolloutConfig, algorithm: AlgorithmConfig, data: DataConfig) -> Sampler:
    """The step's sampler, streamed (``rollout.streaming``) or in rounds, of ``parts`` and
    the three sections (:class:`~dapo_megatron.sampling.sampler.Sampler`'s arguments)."""
    kind = StreamingSampler if rollout.streaming else RoundSampler
    return kind(*parts, rollout=rollout, algorithm=algorithm, data=data)
