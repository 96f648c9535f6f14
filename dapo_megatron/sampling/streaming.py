"""Streamed dynamic sampling: generation that does not wait for the slowest response.

In rounds (``rollout.streaming: false``) a round of ``gen_batch_size x n`` responses
ends with its longest response, and dynamic sampling then drops the groups whose answers
agree and draws another whole round. Here the engines hand back each *group* as soon as
its last response ends; it is scored and filtered at once, and prompts are fed only
while the kept groups are short of ``train_batch_size`` (at most
``rollout.max_prompts_in_flight`` generating at a time). When the batch is full the
engines abort what is still generating, so no step waits for a tail. Two more switches
waste nothing already generated:

- ``rollout.carry_over``: kept groups beyond the batch start the next step's batch.
- ``rollout.partial_rollout``: a response cut by the abort keeps its tokens and their
  sampling log-probs and continues in the next step, under the new weights, first.

Every token records the weight version that sampled it, as its engine reported; a group
whose oldest token lags the actor by more than ``rollout.max_staleness`` is dropped and
counted, and the loss corrects the rest by each token's own rollout log-prob (TIS/MIS).

The engines advance in lockstep, a chunk of tokens per tick, and the driver takes each
tick's completed groups in key order, so on the transformers engine which groups are
kept, and what a resumed run generates, depend on the data alone, never on which engine
answered first. SGLang schedules tokens itself: its tick ends when a request finishes
(or after ``stream_wait_s``), so there which groups complete first, and so the batch,
depend on timing, and a resumed run continues correctly but not identically. What is
carried or in flight is part of a checkpoint's state (:meth:`StreamingSampler.state_dict`).

Multi-turn episodes (``rollout.env``) stream too: a row's turn ends at the environment's
stop string, and a group whose rows have all ended their turns comes back; the episodes
answer (``sampling/episodes.py``: the same turns as in rounds), the answers are appended
to the rows, and the group goes back to an engine first, its rows continuing from
everything so far, until every episode of the group has ended. An abort cuts an episode
mid-turn like any response; with ``partial_rollout`` it continues there, and the
checkpoint keeps its turns (each episode is replayed from them on resume, so an episode
must depend only on its prompt and its turns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from dapo_megatron.algo.dynamic_sampling import DynamicSamplingExhausted
from dapo_megatron.data import Prompt
from dapo_megatron.rollout import routed_experts
from dapo_megatron.rollout.engine import Generation, SamplingParams, StreamGroup, StreamRow, stop_string_end
from dapo_megatron.rollout.seeds import prompt_sampling_seeds
from dapo_megatron.sampling.environments import Episode
from dapo_megatron.sampling.episodes import EpisodeStats, Trajectory, episode_metrics, play_turns
from dapo_megatron.sampling.sampler import Sampler
from dapo_megatron.sampling.samples import (
    Sample,
    apply_rewards,
    response_metrics,
    reward_results,
    samples_from_record,
    samples_record,
    without_routing,
)

KEY_STEP_SHIFT = 32
"""A group's key is ``step << KEY_STEP_SHIFT | draw index within the step``."""


@dataclass
class _Open:
    """A group handed out and not yet back: its prompt, its engine, the group itself (as
    it was handed out, or as it came back)."""

    prompt: Prompt
    engine: int
    group: StreamGroup
    trajectories: Optional[list[Trajectory]] = None
    """Multi-turn episodes: each row's episode so far (its model turns and observations,
    up to the current turn)."""
    episodes: Optional[list[Optional[Episode]]] = None
    """Multi-turn episodes: each row's running episode (None once it has ended)."""

    def back(self, group: StreamGroup) -> int:
        """Take the group as it came back; the tokens generated since it was handed out."""
        new = group.num_tokens - self.group.num_tokens
        self.group = group
        return new


def _partial_rows(item: _Open) -> int:
    """Rows of a group cut while generating: unfinished, holding tokens."""
    return sum(row.finish_reason is None and bool(row.token_ids) for row in item.group.rows)


def _running(item: _Open) -> int:
    """Rows of a group still to generate."""
    return sum(row.finish_reason is None for row in item.group.rows)


def _context(item: _Open) -> int:
    """Tokens a chunk of the group's running rows reads (its prompt and what they hold)."""
    g = item.group
    return sum(len(g.prompt_ids) + len(row.token_ids) for row in g.rows if row.finish_reason is None)


def _assign(
    waiting: list[_Open], load: list[int], context: list[int], capacity: list[int], chunk: int
) -> list[tuple[_Open, int]]:
    """Hand waiting groups (from the front of ``waiting``) to engines with room in rows:
    when every engine is idle and no group holds tokens yet, in contiguous shares engine
    by engine (as rounds split a round, so that one tick per round samples what rounds
    do); otherwise each group to the engine with the least work per chunk (rows times
    ``chunk`` decoded plus the context tokens read again; the lowest index on a tie).
    ``load`` (rows) and ``context`` (tokens) are updated in place."""
    assigned = []

    def fits(engine: int) -> bool:
        return load[engine] == 0 or load[engine] + _running(waiting[0]) <= capacity[engine]

    def give(engine: int) -> None:
        item = waiting.pop(0)
        assigned.append((item, engine))
        load[engine] += _running(item)
        context[engine] += _context(item)

    if not any(load) and not any(item.group.num_tokens for item in waiting):
        for engine in range(len(load)):
            while waiting and fits(engine):
                give(engine)
        return assigned
    while waiting:
        open_engines = [e for e in range(len(load)) if fits(e)]
        if not open_engines:
            break
        give(min(open_engines, key=lambda e: (load[e] * chunk + context[e], e)))
    return assigned


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


class StreamingSampler(Sampler):
    """Collects one step's batch by streamed generation (see the module docstring); given
    what every :class:`~dapo_megatron.sampling.sampler.Sampler` is."""

    def __init__(self, *parts, **sections) -> None:
        super().__init__(*parts, **sections)
        self.carried: list[list[Sample]] = []  # kept groups beyond the last batch
        self.partial: list[_Open] = []  # groups cut by the last abort, to continue
        self.timeline: list[dict] = []  # the last step's ticks: start, wall, each engine's busy seconds
        self._dropped_now: list[tuple[list[Sample], str]] = []  # this step's, so far
        self._stream_sampling: SamplingParams = self.sampling
        if self.episodes is not None:  # a turn ends at the environment's stop strings too
            stops = (*self.sampling.stop_strings, *self.episodes.environment.stop_strings)
            self._stream_sampling = replace(self.sampling, stop_strings=stops)

    # ------------------------------------------------------------------ one step

    def collect(self, step: int, version: int, times: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """Step ``step``'s batch, the actor being at ``version`` (what the engines hold);
        its samples (groups consecutive) and the rollout's metrics. ``times`` gets the
        seconds of ``generate`` (engine ticks) and ``reward``."""
        r, a, d = self.rollout, self.algorithm, self.data
        batch_size = d.train_batch_size
        per_round = d.gen_batch_size or batch_size
        num_engines = len(self.engines.engines)
        capacity = [max(c, 1) for c in _split(r.max_prompts_in_flight or per_round, num_engines)]
        max_drawn = a.max_num_gen_batches * per_round
        c = _Counts()
        self._dropped_now: list[tuple[list[Sample], str]] = []

        kept: list[list[Sample]] = []
        for group in self.carried:  # carried groups first, unless too old
            lag = version - min(s.policy_version for s in group)
            if lag > r.max_staleness:
                c.dropped_stale_groups += 1
                self._dropped_now.append((without_routing(group), "stale"))
                continue
            kept.append(group)
            c.carried_in += 1
            c.carried_age_max = max(c.carried_age_max, lag)
        self.carried = []
        waiting: list[_Open] = []  # partial groups continue before any new prompt
        for item in self.partial:
            versions = [v for row in item.group.rows for v in row.versions]
            lag = version - min(versions) if versions else 0
            if lag > r.max_staleness:
                c.dropped_stale_partial += 1
                c.aborted_tokens += item.group.num_tokens
                _close(item)
                continue
            waiting.append(item)
            c.partial_in += _partial_rows(item)
            c.partial_age_max = max(c.partial_age_max, lag)
        self.partial = []

        # Each engine's load in rows still generating (as it reported after the last
        # tick, plus rows handed out since): a group whose other rows have finished holds
        # only its running rows' share of the bound, so engines stay full.
        n = r.n_samples_per_prompt
        rows_capacity = [cap * n for cap in capacity]
        load = [0] * num_engines
        context = [0] * num_engines  # the context tokens of those rows
        open_groups: dict[int, _Open] = {}
        drawn = 0
        self.timeline = []
        phase_start = time.perf_counter()
        while len(kept) < batch_size:
            # New prompts for the room in whole groups, after the groups already waiting.
            wanted = sum(max(cap - used, 0) // n for cap, used in zip(rows_capacity, load)) - len(waiting)
            if max_drawn:
                wanted = min(wanted, max_drawn - drawn)
            if wanted > 0:
                prompts = self.loader.next_batch(wanted)
                waiting += [self._new_group(step, drawn + i, prompt) for i, prompt in enumerate(prompts)]
                drawn += len(prompts)
            adds: list[list[StreamGroup]] = [[] for _ in range(num_engines)]
            for item, engine in _assign(waiting, load, context, rows_capacity, r.stream_chunk_tokens):
                item.engine = engine
                adds[engine].append(item.group)
                open_groups[item.group.key] = item
            if not open_groups:
                raise DynamicSamplingExhausted(self._exhausted_message(drawn, c, len(kept) - c.carried_in))
            answers, completed = self._tick(adds, r.stream_chunk_tokens, False, phase_start, times)
            load = [answer["running_rows"] for answer in answers]
            context = [answer["running_tokens"] for answer in answers]
            done = [open_groups.pop(g.key) for g in completed]
            for item, g in zip(done, completed):  # tokens count when their group comes back
                c.generated_tokens += item.back(g)
            done, going_on = self._play_turns(done, times)
            waiting[:0] = going_on  # episodes with another turn to take, first
            kept += self._score_and_filter(done, c, times)

        if open_groups:  # the batch is full: stop what is still generating
            _, back = self._tick([[] for _ in range(num_engines)], 0, True, phase_start, times)
            finished, cut = [], []  # complete before the abort took effect (SGLang), and cut
            for g in back:
                item = open_groups.pop(g.key)
                c.generated_tokens += item.back(g)
                (finished if g.done else cut).append(item)
            finished, going_on = self._play_turns(finished, times)  # episodes between turns: cut too
            for item in cut + going_on:
                if r.partial_rollout:
                    self.partial.append(item)
                else:
                    c.aborted_tokens += item.group.num_tokens
                    c.aborted_groups += 1
                    _close(item)
            kept += self._score_and_filter(finished, c, times)  # beyond the batch: carried or trimmed
        # Held over to the next step, first: partial groups there was no room for (a batch
        # full of carried groups), episodes between two turns (kept as partial responses
        # are, or dropped) and prompts drawn that no engine had whole-group room for
        # (their prompts are used, not skipped; they hold no tokens).
        for item in waiting:
            if item.group.num_tokens and not r.partial_rollout:
                c.aborted_tokens += item.group.num_tokens
                c.aborted_groups += 1
                _close(item)
            else:
                self.partial.append(item)
        phase = time.perf_counter() - phase_start
        times.setdefault("generate", 0.0)  # a batch of carried groups alone generates nothing
        times.setdefault("reward", 0.0)

        batch_groups, surplus = kept[:batch_size], kept[batch_size:]
        if r.carry_over:
            self.carried = surplus
        else:
            self._dropped_now += [(without_routing(group), "surplus") for group in surplus]
        self.dropped[step] = self._dropped_now
        batch = [sample for group in batch_groups for sample in group]
        c.kept_new = len(kept) - c.carried_in
        return batch, self._metrics(batch, c, drawn, per_round, len(surplus), phase, times)

    def _tick(
        self, adds: list[list[StreamGroup]], max_tokens: int, abort: bool, phase_start: float, times: dict
    ) -> tuple[list[dict], list[StreamGroup]]:
        """One tick on every engine (:meth:`RolloutWorkers.stream_tick`), timed into
        ``times['generate']`` and the timeline; the engines' answers and the groups they
        handed back, in key order (whichever engine answered first)."""
        start = time.perf_counter()
        answers = self.engines.stream_tick(adds, self._stream_sampling, max_tokens, abort=abort)
        wall = time.perf_counter() - start
        times["generate"] = times.get("generate", 0.0) + wall
        tick = {"start": start - phase_start, "wall": wall, "busy": [answer["busy_s"] for answer in answers]}
        self.timeline.append({**tick, "abort": True} if abort else tick)
        return answers, sorted((g for answer in answers for g in answer["groups"]), key=lambda g: g.key)

    def _new_group(self, step: int, index: int, prompt: Prompt) -> _Open:
        """Draw ``index`` of ``step``: its rows seeded as generation round ``index //
        gen_batch_size``'s prompt ``index % gen_batch_size`` would be (so streaming with
        one tick per round samples what rounds do)."""
        r, d = self.rollout, self.data
        per_round = d.gen_batch_size or d.train_batch_size
        round_index, position = divmod(index, per_round)
        n = r.n_samples_per_prompt
        seeds = prompt_sampling_seeds(r.seed, step, round_index, position, n)
        group = StreamGroup(step << KEY_STEP_SHIFT | index, list(prompt.token_ids), [StreamRow(s) for s in seeds])
        if self.episodes is None:
            return _Open(prompt, -1, group)
        trajectories = [Trajectory(0) for _ in seeds]
        episodes = [self.episodes.environment.start(prompt) for _ in seeds]
        return _Open(prompt, -1, group, trajectories, episodes)

    def _play_turns(self, items: list[_Open], times: dict) -> tuple[list[_Open], list[_Open]]:
        """Multi-turn episodes: each group's rows have ended their turns; each episode
        answers its row's turn (timed into ``times['generate']``), the answer is appended
        to the row, and the rows whose episodes go on are reopened at their next turn.
        The groups whose episodes have all ended, and those that go on."""
        if self.episodes is None:
            return items, []
        start = time.perf_counter()
        played, rows = [], []
        for item in items:
            for index, row in enumerate(item.group.rows):
                trajectory = item.trajectories[index]
                if trajectory.finish_reason is not None:
                    continue  # ended in an earlier turn
                held = len(trajectory.token_ids)
                _end_at_first_stop(row, held, self._stream_sampling.stop_strings, self.tokenizer)
                row.routed_experts = routed_experts.cut(
                    row.routed_experts, len(item.group.prompt_ids) + len(row.token_ids) - 1
                )
                turn = Generation(
                    0,
                    row.token_ids[held:],
                    row.log_probs[held:],
                    row.finish_reason,
                    weight_version=min(row.versions[held:], default=-1),
                )
                played.append((trajectory, item.episodes[index], turn))
                rows.append((item, index, len(row.token_ids)))
        rules = self.episodes
        stop = self._stream_sampling.stop_strings
        limit = min(self.rollout.max_response_length, self._stream_sampling.max_new_tokens)
        play_turns(played, rules.environment, self.tokenizer, stop, rules.max_turns, limit, rules.framing)
        for item, index, held in rows:
            trajectory, row = item.trajectories[index], item.group.rows[index]
            observed = trajectory.token_ids[held:]  # what the episode answered, if anything
            row.token_ids += observed
            row.log_probs += [0.0] * len(observed)
            row.versions += [row.versions[-1] if row.versions else -1] * len(observed)
            if trajectory.finish_reason is None:
                row.finish_reason, row.turn_start = None, len(row.token_ids)
            elif item.episodes[index] is not None:
                item.episodes[index].close()
                item.episodes[index] = None
        times["generate"] = times.get("generate", 0.0) + time.perf_counter() - start
        ended = [item for item in items if item.group.done]
        return ended, [item for item in items if not item.group.done]

    def _score_and_filter(self, items: list[_Open], c: _Counts, times) -> list[list[Sample]]:
        """The completed groups as samples, scored; those dynamic sampling keeps."""
        groups = []
        for group in (self._samples_of(item) for item in items):
            if any(s.finish_reason == "abort" for s in group):  # the engine gave up on it: not scored
                c.engine_aborted += sum(s.finish_reason == "abort" for s in group)
                self._dropped_now.append((without_routing(group), "aborted"))
                continue
            groups.append(group)
        if not groups:
            return []
        flat = [sample for group in groups for sample in group]
        start = time.perf_counter()
        apply_rewards(flat, reward_results(self.rewards, flat), self.algorithm, self.rollout.max_response_length)
        c.episodes += [s.episode for s in flat if s.episode is not None]
        c.model_tokens += sum(sum(s.model_mask) for s in flat if s.model_mask is not None)
        times["reward"] = times.get("reward", 0.0) + time.perf_counter() - start
        c.timeouts += sum(s.timed_out for s in flat)
        c.errors += sum(s.reward_error for s in flat)
        c.scored_responses += len(flat)
        kept = []
        for group in groups:
            c.generated_groups += 1
            outcomes = {s.correct for s in group}
            if len(outcomes) == 1:
                c.all_equal += 1
                if self.algorithm.dynamic_sampling:
                    self._dropped_now.append((without_routing(group), "all_right" if group[0].correct else "all_wrong"))
                    continue
            kept.append(group)
        return kept

    def _samples_of(self, item: _Open) -> list[Sample]:
        g = item.group
        step, index = g.key >> KEY_STEP_SHIFT, g.key & ((1 << KEY_STEP_SHIFT) - 1)
        samples = []
        for row_index, row in enumerate(g.rows):
            sample = Sample(
                group_id=(step, index),
                prompt=item.prompt,
                response_ids=list(row.token_ids),
                engine_log_probs=list(row.log_probs),
                finish_reason=row.finish_reason or "abort",
                text=self.tokenizer.decode(row.token_ids, skip_special_tokens=True),
                policy_version=min(row.versions) if row.versions else -1,
                token_versions=list(row.versions),
                routed_experts=row.routed_experts,
            )
            if item.trajectories is not None:  # as rounds make an episode's sample
                trajectory = item.trajectories[row_index]
                reason = trajectory.finish_reason
                sample.finish_reason = "stop" if reason == "max_turns" else reason or sample.finish_reason
                sample.model_mask = list(trajectory.model_mask)
                sample.episode = trajectory.stats
                sample.environment_reward = trajectory.reward
            samples.append(sample)
        return samples

    def _exhausted_message(self, drawn: int, c: _Counts, num_kept: int) -> str:
        a, d = self.algorithm, self.data
        ratio = num_kept / c.generated_groups if c.generated_groups else 0.0
        return (
            f"dynamic sampling could not fill the batch: {drawn} prompts were drawn this step (the bound: "
            f"algorithm.max_num_gen_batches={a.max_num_gen_batches} x data.gen_batch_size="
            f"{d.gen_batch_size or d.train_batch_size}), {c.generated_groups} groups generated and {num_kept} kept "
            f"(keep ratio {ratio:.1%}), but data.train_batch_size={d.train_batch_size} are needed. Raise "
            "algorithm.max_num_gen_batches (0 = unlimited) or data.gen_batch_size; a keep ratio this low also means "
            "the prompts are too easy or too hard for the model"
        )

    def _metrics(self, batch, c: _Counts, drawn, per_round, surplus, phase, times) -> dict[str, float]:
        r = self.rollout
        trained_tokens = sum(len(s.response_ids) for s in batch)
        versions = [v for s in batch for v in (s.token_versions or [s.policy_version])]
        busy = [sum(tick["busy"][e] for tick in self.timeline) for e in range(len(self.engines.engines))]
        idle = [max(phase - b, 0.0) for b in busy]
        metrics = {
            **response_metrics(batch, r.max_response_length),
            "reward/timeouts": float(c.timeouts),
            "reward/errors": float(c.errors),
            "rollout/aborted_responses": float(c.engine_aborted),
            "dynamic_sampling/generated": float(c.generated_groups),
            "dynamic_sampling/kept": float(c.kept_new),
            "dynamic_sampling/rounds": drawn / per_round,
            "dynamic_sampling/keep_ratio": c.kept_new / c.generated_groups if c.generated_groups else 0.0,
            "dynamic_sampling/trimmed": 0.0 if r.carry_over else float(surplus),
            "dynamic_sampling/batch_groups": len(batch) / r.n_samples_per_prompt,
            "dynamic_sampling/all_equal_share": c.all_equal / max(c.generated_groups, 1),
            "throughput/generate_tokens_per_s": c.generated_tokens / max(times.get("generate", 0.0), 1e-9),
            "throughput/reward_responses_per_s": c.scored_responses / max(times.get("reward", 0.0), 1e-9),
            "data/epoch": float(self.loader.epoch),
            "stream/prompts_drawn": float(drawn),
            "stream/generated_tokens": float(c.generated_tokens),
            "stream/trained_tokens": float(trained_tokens),
            "stream/generated_per_trained_token": c.generated_tokens / max(trained_tokens, 1),
            "stream/aborted_tokens": float(c.aborted_tokens),
            "stream/aborted_groups": float(c.aborted_groups),
            "stream/carried_in_groups": float(c.carried_in),
            "stream/carried_out_groups": float(len(self.carried)),
            "stream/carried_age_max": float(c.carried_age_max),
            "stream/dropped_stale_groups": float(c.dropped_stale_groups + c.dropped_stale_partial),
            "stream/partial_in_responses": float(c.partial_in),
            "stream/partial_out_responses": float(sum(_partial_rows(item) for item in self.partial)),
            "stream/held_over_groups": float(len(self.partial)),
            "stream/partial_out_tokens": float(sum(item.group.num_tokens for item in self.partial)),
            "stream/partial_age_max": float(c.partial_age_max),
            "stream/version_spread": float(max(versions) - min(versions)) if versions else 0.0,
            "stream/ticks": float(len(self.timeline)),
            # Wall-clock figures (time/): each engine's seconds without work in the phase.
            "time/engine_idle_share_max": max(idle) / max(phase, 1e-9),
            "time/engine_idle_share_mean": sum(idle) / len(idle) / max(phase, 1e-9),
            "time/generation_phase": phase,
        }
        for engine, seconds in enumerate(idle):
            metrics[f"time/engine{engine}_idle"] = seconds
        if self.episodes is not None:  # every episode scored this step (those of dropped groups too; not aborted ones)
            metrics.update(episode_metrics(c.episodes, c.model_tokens))
        return metrics

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        """What is carried and in flight between steps (tensors, lists, numbers, strings:
        ``torch.save`` it and read it back with ``weights_only``)."""
        carried = [sample for group in self.carried for sample in group]
        return {
            "format": 1,
            "carried_sizes": [len(group) for group in self.carried],
            "carried": samples_record(carried, {}),
            "partial": [
                {
                    "key": item.group.key,
                    "prompt": [item.prompt.prompt_id, torch.tensor(item.prompt.token_ids, dtype=torch.int64)]
                    + [item.prompt.ground_truth, item.prompt.data_source, item.prompt.text],
                    "prompt_ids": torch.tensor(item.group.prompt_ids, dtype=torch.int64),
                    "rows": [
                        {
                            "seed": row.seed,
                            "token_ids": torch.tensor(row.token_ids, dtype=torch.int64),
                            "log_probs": torch.tensor(row.log_probs, dtype=torch.float64),
                            "versions": torch.tensor(row.versions, dtype=torch.int64),
                            "finish_reason": row.finish_reason or "",
                            "turn_start": row.turn_start,
                            "routed_experts": None
                            if row.routed_experts is None
                            else torch.from_numpy(row.routed_experts),
                        }
                        for row in item.group.rows
                    ],
                    "episodes": [_episode_state(t) for t in item.trajectories or []],
                }
                for item in self.partial
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != 1:
            raise ValueError(f"not a streamed-generation state written by this version (format {state.get('format')})")
        samples, _ = samples_from_record(state["carried"])
        self.carried, start = [], 0
        for size in state["carried_sizes"]:
            self.carried.append(samples[start : start + size])
            start += size
        self.partial = []
        for item in state["partial"]:
            prompt_id, token_ids, ground_truth, data_source, text = item["prompt"]
            prompt = Prompt(prompt_id, tuple(token_ids.tolist()), ground_truth, data_source, text)
            rows = [
                StreamRow(
                    row["seed"],
                    row["token_ids"].tolist(),
                    row["log_probs"].tolist(),
                    row["versions"].tolist(),
                    row["finish_reason"] or None,
                    row.get("turn_start", 0),
                    None if row.get("routed_experts") is None else row["routed_experts"].numpy(),
                )
                for row in item["rows"]
            ]
            restored = _Open(prompt, -1, StreamGroup(item["key"], item["prompt_ids"].tolist(), rows))
            if bool(item.get("episodes")) != (self.episodes is not None):
                raise ValueError(
                    "the checkpoint's responses in flight were generated "
                    + (
                        "as multi-turn episodes, but rollout.env is unset"
                        if item.get("episodes")
                        else "single-turn, but rollout.env is set"
                    )
                    + ": resume with the run's rollout.env"
                )
            if item.get("episodes"):
                restored.trajectories = [_trajectory(state, row) for state, row in zip(item["episodes"], rows)]
                restored.episodes = [self._replayed(prompt, t) for t in restored.trajectories]
            self.partial.append(restored)

    def _replayed(self, prompt: Prompt, trajectory: Trajectory) -> Optional[Episode]:
        """The episode of ``trajectory`` as it was after its last answered turn: begun
        again and given its turns, one by one (None when it has ended)."""
        if trajectory.finish_reason is not None:
            return None
        episode = self.episodes.environment.start(prompt)
        start = 0
        for end in trajectory.turn_ends:
            while start < end and not trajectory.model_mask[start]:  # the observation before the turn
                start += 1
            ids = trajectory.token_ids[start:end]
            episode.step(ids, self.tokenizer.decode(ids, skip_special_tokens=True))
            start = end
        return episode


def _end_at_first_stop(row: StreamRow, turn_start: int, stop_strings: tuple[str, ...], tokenizer) -> None:
    """End ``row``'s turn right after the first stop string in it. An engine that looks
    for stop strings only in what one request generated (SGLang) misses one begun before
    an abort and completed in the request that continued the row; the tokens it sampled
    after it are not the model's turn."""
    end = stop_string_end(tokenizer.decode, row.token_ids[turn_start:], stop_strings)
    if end is not None and turn_start + end < len(row.token_ids):
        keep = turn_start + end
        del row.token_ids[keep:], row.log_probs[keep:], row.versions[keep:]
        row.finish_reason = "stop"


def _close(item: _Open) -> None:
    """End the running episodes of a group that is dropped."""
    for index, episode in enumerate(item.episodes or []):
        if episode is not None:
            episode.close()
            item.episodes[index] = None


def _episode_state(trajectory: Trajectory) -> dict:
    """A row's episode in a checkpoint (its tokens are the row's)."""
    return {
        "length": len(trajectory.token_ids),
        "model_mask": torch.tensor(trajectory.model_mask, dtype=torch.int8),
        "turn_ends": torch.tensor(trajectory.turn_ends, dtype=torch.int64),
        "counts": torch.tensor(
            [
                trajectory.turns,
                trajectory.tool_calls,
                trajectory.tool_errors,
                trajectory.tool_timeouts,
                trajectory.retokenized_differs,
                trajectory.weight_version,
            ],
            dtype=torch.int64,
        ),
        "finish_reason": trajectory.finish_reason or "",
        "reward": torch.tensor([] if trajectory.reward is None else [trajectory.reward], dtype=torch.float64),
    }


def _trajectory(state: dict, row: StreamRow) -> Trajectory:
    length = state["length"]
    turns, calls, errors, timeouts, retokenized, version = state["counts"].tolist()
    reward = state["reward"].tolist()
    return Trajectory(
        0,
        token_ids=row.token_ids[:length],
        log_probs=row.log_probs[:length],
        model_mask=state["model_mask"].tolist(),
        turns=turns,
        turn_ends=state["turn_ends"].tolist(),
        tool_calls=calls,
        tool_errors=errors,
        tool_timeouts=timeouts,
        retokenized_differs=retokenized,
        finish_reason=state["finish_reason"] or None,
        reward=reward[0] if reward else None,
        weight_version=version,
    )


@dataclass
class _Counts:
    """One step's tallies."""

    generated_tokens: int = 0
    aborted_tokens: int = 0
    aborted_groups: int = 0
    generated_groups: int = 0
    all_equal: int = 0
    timeouts: int = 0
    errors: int = 0
    engine_aborted: int = 0
    scored_responses: int = 0
    carried_in: int = 0
    carried_age_max: int = 0
    dropped_stale_groups: int = 0
    dropped_stale_partial: int = 0
    partial_in: int = 0
    partial_age_max: int = 0
    kept_new: int = 0
    episodes: list[EpisodeStats] = field(default_factory=list)
    model_tokens: int = 0
