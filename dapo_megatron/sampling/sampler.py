"""What a step's sampler is given, whichever way it collects the batch (in rounds,
:class:`~dapo_megatron.sampling.rounds.RoundSampler`, or streamed,
:class:`~dapo_megatron.sampling.streaming.StreamingSampler`): the running parts it draws
on and the three sections of the run's config it reads, and nothing else of that config:
``rollout`` (responses per prompt, seed, lengths, streaming), ``algorithm`` (reward
shaping, dynamic sampling) and ``data`` (batch sizes).
"""

from __future__ import annotations

from dapo_megatron.config import AlgorithmConfig, Config, DataConfig, RolloutConfig
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.sampling.episodes import episode_rules


class Sampler:
    """The parts both samplers hold; each answers ``collect(step, version, times)`` and
    keeps what a checkpoint needs in ``state_dict``.

    ``engines``: :class:`~dapo_megatron.orchestration.rollout.RolloutWorkers` (or anything
    with its ``generate``, ``stream_tick`` and ``engines``); ``rewards``: the reward pool;
    ``loader``: the prompt loader; ``sampling``: the training rollouts' sampling;
    ``tokenizer``: the run's tokenizer.
    """

    def __init__(
        self,
        engines,
        rewards,
        loader,
        sampling: SamplingParams,
        tokenizer,
        *,
        rollout: RolloutConfig,
        algorithm: AlgorithmConfig,
        data: DataConfig,
    ) -> None:
        self.engines, self.rewards, self.loader = engines, rewards, loader
        self.sampling, self.tokenizer = sampling, tokenizer
        self.rollout, self.algorithm, self.data = rollout, algorithm, data
        self.episodes = episode_rules(rollout, tokenizer)
        """``rollout.env``'s multi-turn episodes (None: single-turn responses)."""
        self.dropped: dict[int, list[tuple[list, str]]] = {}
        """Each step's groups that were generated and scored but not trained, with why
        (``all_right``, ``all_wrong``: dynamic sampling; ``aborted``: an engine gave up;
        ``stale``: carried too long; ``surplus``: beyond the batch), until the step's
        rollout records take them (:meth:`take_dropped`)."""

    def take_dropped(self, step: int) -> list[tuple[list, str]]:
        """Step ``step``'s dropped groups (see :attr:`dropped`), once."""
        return self.dropped.pop(step, [])


def sampler_sections(config: Config) -> dict:
    """The sections of the run's ``config`` a sampler is given (its keyword arguments)."""
    return {"rollout": config.rollout, "algorithm": config.algorithm, "data": config.data}
