"""Sampling seeds: one per response row, distinct for every (step, round, prompt, sample)
of a run whichever engine samples the row; and resume refuses settings that the saved
data position depends on."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.config import Config, ConfigError
from dapo_megatron.orchestration.rollout import engine_shares
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.seeds import sampling_seeds
from dapo_megatron.rollout.sglang_engine import row_sampling_params
from dapo_megatron.run.resume import RESUME_KEYS, _check_resumable, _setting


def _old_scheme(seed: int, step: int, round_index: int, rows_per_engine: int, num_engines: int) -> list[int]:
    """The seeds before: ``seed + 1_000_003 * step + 1009 * round``, plus the engine's
    index, plus the row (SGLang)."""
    request = seed + 1_000_003 * step + 1009 * round_index
    return [request + engine + row for engine in range(num_engines) for row in range(rows_per_engine)]


def test_every_row_of_a_run_gets_its_own_seed():
    seeds = [
        s
        for step in range(1, 30)
        for round_index in range(3)
        for s in sampling_seeds(1234, step, round_index, num_prompts=32, n=16)
    ]
    assert len(seeds) == len(set(seeds)) == 29 * 3 * 32 * 16
    assert all(0 <= s < 2**63 for s in seeds)  # SGLang's int64 range
    # Negative control: the old scheme reused seeds between engines at once (engine 1's
    # row 0 is engine 0's row 1), and between rounds once a round had >= 1009 rows.
    old = _old_scheme(1234, 1, 0, 256, 2)
    assert len(set(old)) < len(old)
    old_rounds = _old_scheme(1234, 1, 0, 2048, 1) + _old_scheme(1234, 1, 1, 2048, 1)
    assert len(set(old_rounds)) < len(old_rounds)
    # Deterministic, and another run seed gives other seeds.
    assert sampling_seeds(1234, 5, 1, 4, 2) == sampling_seeds(1234, 5, 1, 4, 2) != sampling_seeds(1235, 5, 1, 4, 2)


def test_seed_fields_out_of_range_are_refused():
    with pytest.raises(ValueError, match="sample 4096 is outside 0..4095"):
        sampling_seeds(0, 1, 0, 2, 4097)
    with pytest.raises(ValueError, match="round 1024 is outside"):
        sampling_seeds(0, 1, 1024, 2, 2)


def test_engines_get_their_rows_seeds_and_sglang_uses_one_per_row():
    seeds = sampling_seeds(7, 3, 1, 5, 2)
    params = SamplingParams(row_seeds=seeds)
    shares = engine_shares(5, 2, params, 2)
    assert [(i, a, b) for i, a, b, _ in shares] == [(0, 0, 3), (1, 3, 5)]
    assert shares[0][3].row_seeds + shares[1][3].row_seeds == seeds
    assert [r["sampling_seed"] for r in row_sampling_params(shares[1][3], 4)] == list(seeds[6:])
    # One request seed (validation, eval): rows still get distinct seeds across engines.
    one = engine_shares(4, 2, SamplingParams(seed=11), 3)
    rows = [s for *_, p in one for s in p.row_seeds]
    assert len(rows) == len(set(rows)) == 12
    with pytest.raises(ValueError, match="3 row seeds for 5 prompts x 2 samples"):
        engine_shares(5, 2, SamplingParams(row_seeds=(1, 2, 3)), 2)


def test_resume_refuses_changed_data_settings():
    config = Config()
    state = {
        "num_prompts": 10,
        "rollout_seed": config.rollout.seed,
        "settings": {key: _setting(config, key) for key in RESUME_KEYS},
    }
    _check_resumable((Path("ckpt"), state), config, 10)  # unchanged: accepted
    config.data.seed += 1
    config.rollout.n_samples_per_prompt = 3
    with pytest.raises(ConfigError, match=r"data.seed=43 \(saved with 42\), rollout.n_samples_per_prompt=3"):
        _check_resumable((Path("ckpt"), state), config, 10)


def test_a_streamed_draw_computes_only_its_own_rows_seeds(monkeypatch):
    """A streamed draw's rows get the seeds the same prompt of a generation round gets
    (the full round's computation, sliced), and computing them costs n mixes, not the
    (position + 1) x n of every earlier prompt of the round (O(G^2 n) a round)."""
    from types import SimpleNamespace

    from dapo_megatron.data.prompts import Prompt
    from dapo_megatron.rollout import seeds as seeds_module
    from dapo_megatron.sampling.streaming import KEY_STEP_SHIFT, StreamingSampler

    def sampler(seed: int, n: int, gen_batch_size: int):
        rollout = SimpleNamespace(seed=seed, n_samples_per_prompt=n)
        data = SimpleNamespace(gen_batch_size=gen_batch_size, train_batch_size=gen_batch_size)
        return SimpleNamespace(rollout=rollout, data=data, episodes=None)

    prompt = Prompt(0, (1, 2, 3), "1", "test", "p")
    fake = sampler(1234, 3, 7)
    for step in (0, 1, 5, 200):
        for index in range(23):  # rounds 0..3, every position of a round
            round_index, position = divmod(index, 7)
            group = StreamingSampler._new_group(fake, step, index, prompt).group
            full = sampling_seeds(1234, step, round_index, 7, 3)
            assert [row.seed for row in group.rows] == list(full[position * 3 : (position + 1) * 3])
            assert group.key == step << KEY_STEP_SHIFT | index
    # The work per draw: one mix per row, at the last draw of a 1,536-prompt round too.
    real_mix, calls = seeds_module._mix63, []
    monkeypatch.setattr(seeds_module, "_mix63", lambda x: calls.append(x) or real_mix(x))
    group = StreamingSampler._new_group(sampler(99, 16, 1536), 4, 2 * 1536 + 1535, prompt).group
    assert len(calls) == 16
    monkeypatch.setattr(seeds_module, "_mix63", real_mix)
    assert [row.seed for row in group.rows] == list(sampling_seeds(99, 4, 2, 1536, 16)[1535 * 16 :])
    # Out-of-range fields are refused as for a round's seeds.
    with pytest.raises(ValueError, match="round 1024 is outside"):
        StreamingSampler._new_group(sampler(0, 2, 1), 0, 1024, prompt)
    # The seeds themselves are those of the code before (a run resumed across the change
    # samples the same rows): values computed by the earlier full computation.
    assert sampling_seeds(1234, 5, 1, 2, 2) == (
        6825905800330782499,
        2029199537478595994,
        5876359748925259714,
        2393014427562856502,
    )
    assert seeds_module.prompt_sampling_seeds(1234, 5, 1, 1, 2) == (5876359748925259714, 2393014427562856502)
