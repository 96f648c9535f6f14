"""Streamed dynamic sampling on real transformers engines in Ray (no actor: the engines
keep their initial weights and the tests set the weight version they stamp): the same
batches as rounds when a tick covers a round, order independence, carried groups trained
exactly once with measured staleness, partial responses continued from their exact
prefixes, aborted groups never trained, and a state that resumes exactly."""

from __future__ import annotations

import io
from contextlib import contextmanager

import pytest
import torch

import dapo_megatron.sampling.streaming as stream_sampling
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.config import config_from_dict
from dapo_megatron.orchestration.cluster import RayCluster
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.run.step import check_staleness
from dapo_megatron.run.system import load_run_data
from dapo_megatron.sampling.rounds import RoundSampler, training_sampling
from dapo_megatron.sampling.sampler import sampler_sections
from dapo_megatron.sampling.streaming import StreamingSampler
from tests.e2e.conftest import driver_of, joined, run_config

pytestmark = pytest.mark.timeout(600)


def _config(root, out, address=None, **rollout):
    raw = run_config(root, out)
    if address is not None:
        joined(raw, address)
    raw["rollout"].update({"max_response_length": 12, "streaming": True, "stream_chunk_tokens": 3, **rollout})
    raw["rollout"]["num_engines"] = rollout.get("num_engines", 2)
    raw["algorithm"]["overlong_buffer_len"] = 4
    raw["data"].update({"train_batch_size": 2, "gen_batch_size": 4, "mini_batch_size": 8})
    return config_from_dict(raw, "e2e")


@pytest.fixture(scope="module")
def shared_engines(tiny_model, tmp_path_factory, _shared_ray_head):
    """Two engines, on the package's Ray head, for every test here: they are built from the
    model and the engine count alone (sampling comes with each call, seeded per row), and
    no test syncs weights into them; :func:`_parts` gives them back as a fresh start leaves them."""
    run_dir = tmp_path_factory.mktemp("streaming") / "run"
    with driver_of(_shared_ray_head) as address:
        config = _config(tiny_model, run_dir, address)
        with RayCluster(config.ray, run_dir, 4):
            engines = RolloutWorkers(config)
            try:
                yield engines
            finally:
                engines.shutdown()


@contextmanager
def _parts(config, engines):
    """The shared engines as a fresh start leaves them (alive, no weight version, no group
    in flight: an abort drops what a test that raised left), and a reward pool for ``config``."""
    engines.health()  # an engine an earlier test broke fails here, by name
    engines.set_weight_version(-1)
    engines.stream_tick([[] for _ in engines.engines], None, 0, abort=True)
    rewards = RewardPool(config.algorithm.reward_fn, 5.0, 1)
    try:
        yield engines, rewards
    finally:
        rewards.close()


def _sampler(config, engines, rewards):
    tokenizer, _, _, loader = load_run_data(config)
    return StreamingSampler(
        engines, rewards, loader, training_sampling(config.rollout, tokenizer), tokenizer, **sampler_sections(config)
    )


def _rows(samples):
    return [(s.group_id, s.response_ids, s.engine_log_probs, s.reward, s.policy_version) for s in samples]


class Reordered:
    """The engines, handing back each tick's groups in reverse order, all in the last
    engine's answer (as if they had arrived from there first)."""

    def __init__(self, engines) -> None:
        self.inner, self.engines = engines, engines.engines
        self.aborted: list[int] = []  # keys of the groups every abort cut
        self.aborted_tokens = 0  # the tokens those groups held

    def stream_tick(self, adds, params, max_tokens, abort=False):
        answers = self.inner.stream_tick(adds, params, max_tokens, abort)
        if abort:
            self.aborted += [g.key for answer in answers for g in answer["groups"]]
            self.aborted_tokens += sum(g.num_tokens for answer in answers for g in answer["groups"])
        arrived = [g for answer in answers[::-1] for g in answer["groups"][::-1]]
        return [{**answer, "groups": arrived if i == len(answers) - 1 else []} for i, answer in enumerate(answers)]


def test_streaming_with_one_tick_per_round_samples_the_rounds_batches(tiny_model, tmp_path, shared_engines):
    """Chunks as long as a response and a round's prompts in flight: streaming is rounds,
    to the bit (tokens, log-probs, rewards, versions), over several steps and rounds."""
    config = _config(tiny_model, tmp_path / "run", stream_chunk_tokens=12, max_prompts_in_flight=4)
    with _parts(config, shared_engines) as (engines, rewards):
        tokenizer, _, _, loader = load_run_data(config)
        sampling = training_sampling(config.rollout, tokenizer)
        rounds = []
        in_rounds = RoundSampler(engines, rewards, loader, sampling, tokenizer, **sampler_sections(config))
        for step in (1, 2, 3):
            samples, metrics = in_rounds.collect(step, -1, {})
            rounds.append((samples, metrics))
        streamed = _sampler(config, engines, rewards)
        for step, (expected, expected_metrics) in zip((1, 2, 3), rounds):
            samples, metrics = streamed.collect(step, -1, {})
            assert [row[1:] for row in _rows(samples)] == [row[1:] for row in _rows(expected)]
            for key in ("dynamic_sampling/generated", "dynamic_sampling/rounds", "reward/accuracy"):
                assert metrics[key] == expected_metrics[key], key
        assert any(m["dynamic_sampling/rounds"] > 1 for _, m in rounds)  # dynamic sampling drew again


@pytest.mark.parametrize("sort_arrivals", [True, False])
def test_a_stream_out_of_order_trains_the_same_groups(tiny_model, tmp_path, shared_engines, monkeypatch, sort_arrivals):
    # Chunks as long as a response: every group in flight completes in the same tick, so
    # the order they are taken in decides which fill the batch and which are carried.
    config = _config(tiny_model, tmp_path / "run", carry_over=True, stream_chunk_tokens=12, max_prompts_in_flight=6)
    with _parts(config, shared_engines) as (engines, rewards):
        in_order = _sampler(config, engines, rewards)
        batches = [_rows(in_order.collect(step, 0, {})[0]) for step in (1, 2, 3)]
        if not sort_arrivals:  # negative control: take groups in the order they arrive
            monkeypatch.setattr(stream_sampling, "sorted", lambda groups, key: list(groups), raising=False)
        reordered = _sampler(config, Reordered(engines), rewards)
        again = [_rows(reordered.collect(step, 0, {})[0]) for step in (1, 2, 3)]
        assert (again == batches) == sort_arrivals


def test_carried_groups_are_trained_once_with_measured_staleness(tiny_model, tmp_path, shared_engines):
    config = _config(tiny_model, tmp_path / "run", carry_over=True, max_prompts_in_flight=6)
    with _parts(config, shared_engines) as (engines, rewards):
        sampler = _sampler(config, engines, rewards)
        trained, carried_any = [], False
        for step, version in ((1, 0), (2, 1), (3, 2), (4, 3)):
            engines.set_weight_version(version)
            carried = [s.group_id for group in sampler.carried for s in group[:1]]
            samples, metrics = sampler.collect(step, version, {})
            ids = sorted({s.group_id for s in samples})
            # What was carried is trained next, first in line, or carried on (more than a
            # batch), or dropped as too old, and counted.
            still = {s.group_id for group in sampler.carried for s in group[:1]}
            dropped = [g for g in carried if g not in ids and g not in still]
            assert len(dropped) == metrics["stream/dropped_stale_groups"]
            assert metrics["stream/carried_in_groups"] == len(carried) - len(dropped)
            trained_carried = [g for g in carried if g in ids]
            kept_carried = [g for g in carried if g not in dropped]
            assert trained_carried == kept_carried[: len(trained_carried)]  # in order, first
            assert trained_carried == kept_carried or trained_carried == ids  # the rest: a batch full of them
            lags = check_staleness(samples, version, step, max_lag=1)
            # The staleness is the engine's stamp: carried groups were sampled one version back.
            assert {lag for s, lag in zip(samples, lags) if s.group_id in carried} <= {1}
            assert {lag for s, lag in zip(samples, lags) if s.group_id not in carried} <= {0}
            trained += ids
            carried_any |= bool(carried)
        assert carried_any and len(trained) == len(set(trained))  # no group twice
        # Too old: skip a version; the carried groups are dropped, counted, never trained.
        step, version = 5, 4
        while not sampler.carried and step < 12:  # until a step carries some over
            engines.set_weight_version(version)
            sampler.collect(step, version, {})
            step, version = step + 1, version + 1
        carried = [s.group_id for group in sampler.carried for s in group[:1]]
        assert carried
        engines.set_weight_version(version + 1)
        samples, metrics = sampler.collect(step, version + 1, {})
        assert metrics["stream/dropped_stale_groups"] == len(carried)
        assert not {s.group_id for s in samples} & set(carried)


def test_partial_responses_continue_from_their_prefixes_and_aborted_groups_are_never_trained(
    tiny_model, tmp_path, shared_engines
):
    config = _config(tiny_model, tmp_path / "run", partial_rollout=True, max_prompts_in_flight=6)
    with _parts(config, shared_engines) as (engines, rewards):
        sampler = _sampler(config, engines, rewards)
        continued = 0
        for step in (1, 2, 3, 4):
            engines.set_weight_version(step - 1)
            prefixes = {
                (item.group.key >> 32, item.group.key & 0xFFFFFFFF, i): (list(row.token_ids), list(row.versions))
                for item in sampler.partial
                for i, row in enumerate(item.group.rows)
            }
            samples, metrics = sampler.collect(step, step - 1, {})
            seen: dict = {}
            for sample in samples:
                index = seen[sample.group_id] = seen.get(sample.group_id, -1) + 1
                prefix = prefixes.get((*sample.group_id, index))
                if prefix is None:
                    assert sample.token_versions == [step - 1] * len(sample.response_ids)
                    continue
                tokens, versions = prefix
                assert sample.response_ids[: len(tokens)] == tokens
                assert sample.token_versions[: len(tokens)] == versions
                assert set(sample.token_versions[len(tokens) :]) <= {step - 1}
                continued += len(sample.response_ids) > len(tokens) and bool(tokens)
            check_staleness(samples, step - 1, step, max_lag=1)
        assert continued  # some response went on under newer weights

    config = _config(tiny_model, tmp_path / "off", max_prompts_in_flight=6)
    with _parts(config, shared_engines) as (engines, rewards):
        proxy = Reordered(engines)
        sampler = _sampler(config, proxy, rewards)
        trained = []
        for step in (1, 2, 3):
            groups_before, tokens_before = len(proxy.aborted), proxy.aborted_tokens
            samples, metrics = sampler.collect(step, 0, {})
            trained += [s.group_id for s in samples]
            # Without carry_over or partial_rollout every group the step's abort cuts is
            # thrown away and counted: exactly the groups (of this step) and tokens the
            # engines handed back from the abort.
            cut = proxy.aborted[groups_before:]
            assert metrics["stream/aborted_groups"] == len(cut)
            assert metrics["stream/aborted_tokens"] == proxy.aborted_tokens - tokens_before
            assert {key >> 32 for key in cut} <= {step}
        aborted = {(key >> 32, key & 0xFFFFFFFF) for key in proxy.aborted}
        assert aborted and not aborted & set(trained)


def test_the_state_resumes_exactly_with_carried_and_partial_groups_in_flight(tiny_model, tmp_path, shared_engines):
    config = _config(tiny_model, tmp_path / "run", carry_over=True, partial_rollout=True, max_prompts_in_flight=6)
    with _parts(config, shared_engines) as (engines, rewards):
        uninterrupted = _sampler(config, engines, rewards)
        expected = [_rows(uninterrupted.collect(step, 0, {})[0]) for step in (1, 2, 3)]
        first = _sampler(config, engines, rewards)
        assert _rows(first.collect(1, 0, {})[0]) == expected[0]
        assert first.partial or first.carried
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        resumed = _sampler(config, engines, rewards)
        resumed.loader.load_state_dict(first.loader.state_dict())
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        assert [_rows(resumed.collect(step, 0, {})[0]) for step in (2, 3)] == expected[1:]
        fresh = _sampler(config, engines, rewards)  # negative control: without the state
        fresh.loader.load_state_dict(first.loader.state_dict())
        assert [_rows(fresh.collect(step, 0, {})[0]) for step in (2, 3)] != expected[1:]


def test_a_batch_that_cannot_be_filled_stops_at_the_bound_on_prompts_drawn(tiny_model, tmp_path, shared_engines):
    """Every answer right: every group agrees, none is kept; the step stops after
    max_num_gen_batches x gen_batch_size prompts with the rounds' actionable message."""
    raw = run_config(tiny_model, tmp_path / "run")
    raw["rollout"].update(streaming=True, stream_chunk_tokens=3, num_engines=2)
    raw["algorithm"].update(reward_fn="tests.e2e.rewards:always_right", max_num_gen_batches=2)
    config = config_from_dict(raw, "e2e")
    with _parts(config, shared_engines) as (engines, rewards):
        sampler = _sampler(config, engines, rewards)
        with pytest.raises(stream_sampling.DynamicSamplingExhausted) as info:
            sampler.collect(1, 0, {})
        message = str(info.value)
        assert "8 prompts were drawn" in message and "algorithm.max_num_gen_batches=2" in message
        assert "0 kept" in message and "Raise algorithm.max_num_gen_batches" in message
        assert sampler.loader.state_dict()["position"] == 8  # exactly the bound, not a prompt more
