"""The transformers engine's streamed generation: groups back when complete, aborts that
hand back exact prefixes, continuations under new weights with per-token versions."""

from __future__ import annotations

import copy

import pytest
import torch

from dapo_megatron.rollout.engine import SamplingParams, StreamGroup, StreamRow
from dapo_megatron.rollout.hf_engine import HFRolloutEngine
from dapo_megatron.rollout.seeds import sampling_seeds
from tests.unit.test_hf_engine import buckets_of, tiny_model

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(7,))


def groups(prompts, seeds, n):
    return [
        StreamGroup(key, list(prompt), [StreamRow(seed) for seed in seeds[key * n : (key + 1) * n]])
        for key, prompt in enumerate(prompts)
    ]


@pytest.fixture
def engine():
    torch.manual_seed(0)
    return HFRolloutEngine.from_model_config(tiny_model())


PROMPTS = [[3, 4, 5], [9, 10], [11, 12, 13, 14]]


def test_one_chunk_of_whole_responses_samples_what_generate_does(engine):
    seeds = sampling_seeds(1234, 3, 0, len(PROMPTS), 2)
    expected = engine.generate(PROMPTS, SamplingParams(**{**SAMPLING.__dict__, "row_seeds": seeds}), n=2)
    engine.stream_add(groups(PROMPTS, seeds, 2), SAMPLING)
    done = engine.stream_step(SAMPLING.max_new_tokens, version=5)
    assert [g.key for g in done] == [0, 1, 2]
    rows = [row for g in done for row in g.rows]
    assert [row.token_ids for row in rows] == [e.token_ids for e in expected]
    assert [row.log_probs for row in rows] == [e.log_probs for e in expected]
    assert [row.finish_reason for row in rows] == [e.finish_reason for e in expected]
    assert all(row.versions == [5] * len(row.token_ids) for row in rows)
    assert engine.stream_step(4, version=5) == [] and engine.stream_abort(0) == []


def test_groups_come_back_as_they_complete_and_abort_returns_the_rest(engine):
    seeds = sampling_seeds(1, 0, 0, len(PROMPTS), 3)
    engine.stream_add(groups(PROMPTS, seeds, 3), SAMPLING)
    returned, ticks = [], 0
    while ticks < 3:
        for group in engine.stream_step(2, version=0):
            assert group.done  # only whole groups come back
            returned.append(group.key)
        ticks += 1
    cut = engine.stream_abort(0)
    assert sorted(returned + [g.key for g in cut]) == [0, 1, 2]
    assert all(not g.done for g in cut) and engine.stream_abort(0) == []
    for group in cut:  # at most three chunks of two tokens each, nothing past the abort
        assert all(len(row.token_ids) <= 6 for row in group.rows)
        assert any(row.finish_reason is None for row in group.rows)


def test_a_partial_response_continues_from_its_exact_prefix_under_new_weights(engine):
    seeds = sampling_seeds(7, 1, 0, 1, 4)
    long = SamplingParams(temperature=1.0, max_new_tokens=20)  # no stop token: every row runs on
    engine.stream_add(groups([PROMPTS[0]], seeds, 4), long)
    assert engine.stream_step(5, version=2) == []
    (cut,) = engine.stream_abort(0)
    prefix = copy.deepcopy(cut)
    assert all(len(row.token_ids) == 5 and row.versions == [2] * 5 for row in cut.rows)
    torch.manual_seed(1)
    newer = HFRolloutEngine.from_model_config(tiny_model())
    engine.update_weights(buckets_of(newer.state_dict()))
    engine.stream_add([cut], long)
    (done,) = engine.stream_step(20, version=3)
    for before, after in zip(prefix.rows, done.rows):
        assert after.token_ids[:5] == before.token_ids and after.log_probs[:5] == before.log_probs
        assert len(after.token_ids) == 20 and after.finish_reason == "length"
        assert after.versions == [2] * 5 + [3] * 15
    # The continuation's log-probs are the new weights': the same tokens scored by the new model.
    row = done.rows[0]
    logits = newer.model(torch.tensor([PROMPTS[0] + row.token_ids])).logits[0].float()
    scored = torch.log_softmax(logits, -1)[len(PROMPTS[0]) - 1 : -1].gather(-1, torch.tensor(row.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(row.log_probs[5:]), scored[5:, 0], atol=1e-5, rtol=0)
    with pytest.raises(AssertionError):  # negative control: the old weights' scores differ
        old = HFRolloutEngine.from_model_config(tiny_model())
        logits = old.model(torch.tensor([PROMPTS[0] + row.token_ids])).logits[0].float()
        rescored = torch.log_softmax(logits, -1)[len(PROMPTS[0]) - 1 : -1]
        rescored = rescored.gather(-1, torch.tensor(row.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(row.log_probs[5:]), rescored[5:, 0], atol=1e-5, rtol=0)


def test_a_response_stops_at_its_limit_even_inside_a_chunk(engine):
    seeds = sampling_seeds(3, 0, 0, 1, 2)
    short = SamplingParams(temperature=1.0, max_new_tokens=7)
    engine.stream_add(groups([PROMPTS[1]], seeds, 2), short)
    assert engine.stream_step(4, version=0) == []
    (done,) = engine.stream_step(4, version=0)
    assert all(len(row.token_ids) == 7 and row.finish_reason == "length" for row in done.rows)


class _Letters:
    """Token i is the letter ``chr(97 + i % 26)``: a stop string's place in a row is plain."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def batch_decode(self, rows):
        return [self.decode(row) for row in rows]


def test_a_turn_stops_at_a_stop_string_across_chunks_and_only_after_its_start():
    """Multi-turn streaming: a stop string that begins in one chunk and ends in the next
    stops the row after the token that completes it; one in the tokens before the
    row's ``turn_start`` (an observation) does not."""
    torch.manual_seed(0)
    engine = HFRolloutEngine.from_model_config(tiny_model(), tokenizer=_Letters())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    (free,) = engine.generate([PROMPTS[0]], greedy)  # the row's tokens without a stop string
    text = _Letters().decode(free.token_ids)
    # A stop string across the first chunk of 4 tokens and the second, the first of its kind.
    first_end = lambda stop: next(k for k in range(1, len(text) + 1) if stop in text[:k])  # noqa: E731
    candidates = [(a, b) for a in (3, 2, 1) for b in (5, 6, 7) if first_end(text[a:b]) == b]
    assert candidates, f"no stop string of the greedy text {text!r} ends where it first appears"
    start, end = candidates[0]
    stop = text[start:end]
    stopping = SamplingParams(temperature=0.0, max_new_tokens=12, stop_strings=(stop,))
    engine.stream_add([StreamGroup(0, list(PROMPTS[0]), [StreamRow(1)])], stopping)
    assert engine.stream_step(4, version=0) == []
    (done,) = engine.stream_step(4, version=0)
    assert done.rows[0].token_ids == free.token_ids[:end] and done.rows[0].finish_reason == "stop"
    assert len(done.rows[0].log_probs) == len(done.rows[0].versions) == end
    # The same text in the row's tokens before its turn (what an environment wrote) does
    # not stop it; counted from 0, it would (right after it).
    for turn_start, reason, length in ((end - start, None, end - start + 1), (0, "stop", end - start)):
        held = free.token_ids[start:end]
        row = StreamRow(1, list(held), [0.0] * len(held), [0] * len(held), None, turn_start=turn_start)
        engine.stream_add([StreamGroup(1, list(PROMPTS[0]), [row])], stopping)
        (back,) = engine.stream_step(1, version=0) or engine.stream_abort(0)
        assert (back.rows[0].finish_reason, len(back.rows[0].token_ids)) == (reason, length)


def test_groups_go_in_contiguous_shares_when_all_is_idle_then_to_the_least_busy_engine():
    from dapo_megatron.data import Prompt
    from dapo_megatron.sampling.streaming import _assign, _Open

    def item(key, tokens=0):
        rows = [StreamRow(key * 10 + i, [5] * tokens, [-1.0] * tokens, [0] * tokens) for i in range(2)]
        return _Open(Prompt(key, (1, 2), "3", "demo", "1+2="), -1, StreamGroup(key, [1, 2], rows))

    waiting = [item(k) for k in range(5)]
    load, context = [0, 0], [0, 0]
    assigned = _assign(waiting, load, context, [4, 4], chunk=8)
    assert [(i.group.key, e) for i, e in assigned] == [(0, 0), (1, 0), (2, 1), (3, 1)]  # as rounds split
    assert [i.group.key for i in waiting] == [4] and load == [4, 4]
    # Busy engines: the one with less work per chunk (rows x chunk + context) gets the group.
    waiting = [item(7, tokens=30), item(8)]
    load, context = [2, 2], [10, 80]
    assigned = _assign(waiting, load, context, [6, 6], chunk=8)
    assert [(i.group.key, e) for i, e in assigned] == [(7, 0), (8, 1)]
    assert load == [4, 4] and context == [10 + 2 * 32, 80 + 2 * 2]


class _AbortRaceEngines:
    """Two stand-in engine ticks: the first hands back group 0 complete; the abort hands
    back group 1 complete (it finished in the engine between the tick and the abort, as
    SGLang answers such a request) and group 2 cut after 2 tokens per row."""

    def __init__(self) -> None:
        self.engines = [object()]
        self.groups: dict[int, StreamGroup] = {}

    def stream_tick(self, adds, params, max_tokens, abort=False):
        for group in adds[0]:  # a copy, as a Ray call hands over
            self.groups[group.key] = copy.deepcopy(group)
        key = {group.key & 0xFFFFFFFF: group.key for group in self.groups.values()}  # draw index -> key
        if not abort:
            back = [self._finish(key[0], correct_first=True)]
        else:
            back = [self._finish(key[1], correct_first=True), self._cut(key[2])]
        for group in back:
            del self.groups[group.key]
        return [{"groups": back, "busy_s": 0.0, "running_rows": 0, "running_tokens": 0}]

    def _finish(self, key, correct_first):
        group = self.groups[key]
        for i, row in enumerate(group.rows):  # row 0 answers "1" (right), the others "0" (mixed rewards)
            row.token_ids, row.log_probs, row.versions = [1 if i == 0 and correct_first else 0] * 3, [-0.5] * 3, [7] * 3
            row.finish_reason = "length"
        return group

    def _cut(self, key):
        group = self.groups[key]
        for row in group.rows:
            row.token_ids, row.log_probs, row.versions = [0, 0], [-0.5] * 2, [7] * 2
        return group


class _Loader:
    epoch = 0

    def next_batch(self, count):
        from dapo_megatron.data import Prompt

        return [Prompt(i, (2, 3), "1", "test", "p") for i in range(count)]


class _Rewards:
    def score(self, texts, truths):
        from dapo_megatron.algo.rewards.base import RewardResult

        return [RewardResult(1.0 if t == truth else -1.0, t == truth, t) for t, truth in zip(texts, truths)]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "1" if ids and ids[0] == 1 else "0"


@pytest.mark.parametrize("mode", ["drop", "carry_over", "partial_rollout"])
def test_a_group_that_completed_before_the_abort_is_scored_not_counted_as_aborted(mode):
    """A batch of one group, three in flight: the first tick completes group 0 (the batch
    is full), the abort hands back group 1 complete and group 2 cut. Group 1 is a whole,
    scorable group: it is scored and kept (carried into the next batch with
    ``carry_over``, trimmed without), never counted as aborted nor held over as partial;
    only group 2 is."""
    from dapo_megatron.config import config_from_dict
    from dapo_megatron.sampling.sampler import sampler_sections
    from dapo_megatron.sampling.streaming import StreamingSampler
    from tests.unit.test_config import tiny

    rollout = {"streaming": True, "n_samples_per_prompt": 2, "max_prompts_in_flight": 3}
    if mode != "drop":
        rollout[mode] = True
    raw = tiny(rollout=rollout, data={"train_batch_size": 1, "gen_batch_size": 3, "mini_batch_size": 2})
    config = config_from_dict(raw)
    engines = _AbortRaceEngines()
    sampler = StreamingSampler(
        engines,
        _Rewards(),
        _Loader(),
        SAMPLING,
        _Tokenizer(),
        **sampler_sections(config),
    )
    batch, metrics = sampler.collect(step=1, version=7, times={})
    assert [s.group_id for s in batch] == [(1, 0), (1, 0)]
    assert metrics["dynamic_sampling/generated"] == 2  # groups 0 and 1 were scored
    assert metrics["stream/aborted_groups"] == (0 if mode == "partial_rollout" else 1)  # group 2 only
    assert metrics["stream/aborted_tokens"] == (0 if mode == "partial_rollout" else 4)
    assert metrics["stream/generated_tokens"] == 6 + 6 + 4
    carried = [[s.group_id for s in group] for group in sampler.carried]
    assert carried == ([[(1, 1), (1, 1)]] if mode == "carry_over" else [])
    assert metrics["dynamic_sampling/trimmed"] == (0 if mode == "carry_over" else 1)
    assert [item.group.key & 0xFFFFFFFF for item in sampler.partial] == ([2] if mode == "partial_rollout" else [])
