"""The routing record an engine returns (rollout routing replay): what the transformers
engine records equals the routing of a forward pass over the whole sequence, streamed
responses keep the routing their prefix was sampled with, SGLang's answers decode into
the same record, and samples carry it through a save."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from dapo_megatron.rollout import routed_experts
from dapo_megatron.rollout.engine import SamplingParams, StreamGroup, StreamRow
from dapo_megatron.rollout.hf_engine import HFRolloutEngine
from dapo_megatron.rollout.sglang_engine import routed_experts_of_meta
from tests.distributed.actor_worker import tiny_hf_model

PROMPTS = [[5, 9, 2, 44, 7], [3, 8]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = tiny_hf_model("qwen3_moe", False, seed=5, attn_implementation="eager", mlp_only_layers=[1])
    with torch.no_grad():  # routing far from ties, so a batch's padding cannot flip a choice
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 1.0)
    folder = tmp_path_factory.mktemp("moe")
    model.save_pretrained(folder)
    return HFRolloutEngine.from_pretrained(folder)


def forward_routing(model, ids: list[int]) -> np.ndarray:
    """``[positions, moe_layers, k]``: the routing of one forward pass over ``ids``."""
    recorder = routed_experts.RoutingRecorder(model, 1)
    with recorder, torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return recorder.columns()[0]


def test_generate_records_every_position_but_the_last_as_a_forward_pass_routes_it(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, return_routed_experts=True)
    generations = engine.generate(PROMPTS, params, n=2)
    assert len(routed_experts.moe_routers(engine.model)) == 3  # layer 1 is dense (mlp_only_layers)
    for generation in generations:
        ids = PROMPTS[generation.prompt_index] + generation.token_ids
        record = generation.routed_experts
        assert record.dtype == np.uint8 and record.shape == (len(ids) - 1, 3, 2)
        assert np.array_equal(record, forward_routing(engine.model, ids)[:-1])
    assert all(g.routed_experts is None for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=3)))


def test_a_streamed_response_keeps_the_routing_its_prefix_was_sampled_with(engine):
    """Chunks of 2 tokens, the weights changed after the first: the positions sampled from
    before keep the routing they had (a partial rollout continued under newer weights),
    the later ones have the new weights' routing."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, return_routed_experts=True)
    group = StreamGroup(0, PROMPTS[0], [StreamRow(11)])
    engine.stream_add([group], params)
    engine.stream_step(2, version=0)
    row = group.rows[0]
    assert len(row.token_ids) == 2 and len(row.routed_experts) == len(PROMPTS[0]) + 1
    before = forward_routing(engine.model, PROMPTS[0] + row.token_ids)
    gates = [gate for _, gate in routed_experts.moe_routers(engine.model)]
    saved = [gate.weight.detach().clone() for gate in gates]
    try:
        with torch.no_grad():
            for gate in gates:
                gate.weight.copy_(gate.weight.flip(0))  # another expert order: other routing
        while engine.stream_step(2, version=1) == []:
            pass
        after = forward_routing(engine.model, PROMPTS[0] + row.token_ids)
    finally:
        with torch.no_grad():
            for gate, weight in zip(gates, saved):
                gate.weight.copy_(weight)
    held = len(PROMPTS[0]) + 1
    assert len(row.routed_experts) == len(PROMPTS[0]) + len(row.token_ids) - 1
    assert np.array_equal(row.routed_experts[:held], before[:held])
    assert np.array_equal(row.routed_experts[held:], after[held:-1])
    assert not np.array_equal(before[:held], after[:held])  # the change did move the prefix's routing


def test_sglangs_answer_decodes_into_the_moe_layers_of_the_record():
    """SGLang 0.5.23 sends base64 of int32 ``[prompt + completion - 1, all layers, k]``
    (dense layers as zeros)."""
    sent = np.random.default_rng(0).integers(0, 4, (6, 3, 2)).astype(np.int32)
    sent[:, 1] = 0
    meta = {"routed_experts": base64.b64encode(sent.tobytes()).decode(), "prompt_tokens": 4}
    meta["completion_tokens"] = 3
    record = routed_experts_of_meta(meta, [True, False, True], num_experts=4)
    assert record.dtype == np.uint8 and np.array_equal(record, sent[:, [0, 2]])
    assert routed_experts_of_meta({"prompt_tokens": 4, "completion_tokens": 3}, [True], 4) is None
    with pytest.raises(ValueError, match="not a whole number of experts per token"):
        routed_experts_of_meta({**meta, "completion_tokens": 4}, [True, False, True], num_experts=4)
    wide = routed_experts_of_meta(meta, [True, False, True], num_experts=300)
    assert wide.dtype == np.int16


def test_the_record_travels_with_the_sample_into_the_batch_and_through_a_save(tmp_path):
    from dapo_megatron.config import AlgorithmConfig
    from dapo_megatron.data import Prompt
    from dapo_megatron.sampling.samples import Sample, build_policy_batch, load_samples, save_samples

    prompt = Prompt(0, (1, 2, 3), "4", "demo", "1+3=")
    records = [np.random.default_rng(n).integers(0, 4, (3 + n - 1, 2, 2)).astype(np.uint8) for n in (2, 4)]
    samples = [
        Sample((0, 0), prompt, list(range(n)), [0.0] * n, "stop", "", routed_experts=record, score=float(n))
        for n, record in zip((2, 4), records)
    ]
    save_samples(tmp_path / "s.pt", samples, {})
    loaded, _ = load_samples(tmp_path / "s.pt")
    assert all(np.array_equal(a.routed_experts, b) for a, b in zip(loaded, records))
    batch = build_policy_batch(loaded, AlgorithmConfig())
    assert batch.routed_lengths.tolist() == [4, 6] and tuple(batch.routed_experts.shape) == (2, 7, 2, 2)
    assert np.array_equal(batch.routed_experts[1, :6].numpy(), records[1]) and not batch.routed_experts[0, 4:].any()
    assert batch.routed_experts.dtype == torch.uint8
    trimmed = batch.select([0]).trimmed()
    assert tuple(trimmed.routed_experts.shape) == (1, 5, 2, 2)


def test_loss_tokens_the_record_does_not_reach_are_taken_out_of_the_loss():
    """Under rollout replay a loss token is computed from the position before it: one the
    record does not cover would take stand-in experts. A full record (every position but
    the last) reaches every loss token; a record cut short, or none, takes the rest out."""
    from dapo_megatron.actor.batch import PolicyBatch
    from dapo_megatron.sampling.samples import mask_unreplayed_loss_tokens

    def batch(lengths):
        tokens = torch.zeros(2, 8, dtype=torch.long)
        grid = torch.zeros(2, 8, 2, 2, dtype=torch.uint8)
        return PolicyBatch(
            tokens,
            torch.tensor([3, 2]),
            torch.tensor([4, 6]),
            routed_experts=grid,
            routed_lengths=torch.tensor(lengths),
        )

    full = batch([6, 7])
    assert mask_unreplayed_loss_tokens(full) == 0 and full.loss_mask is None
    short = batch([4, 0])  # row 0 reaches tokens 3..4 of its 3..6; row 1 none of 2..7
    assert mask_unreplayed_loss_tokens(short) == 2 + 6
    assert short.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0] and not short.loss_mask[1].any()


def test_plan_counts_the_records_on_the_driver_and_on_each_rank():
    """``plan``'s bound for the Qwen3-30B-A3B recipe: 48 MoE layers x top 8, a byte per id
    (128 experts); every response at its longest; the driver holds the kept batch and a
    round, an actor rank its replica's share of the kept batch."""
    from dapo_megatron.config import load_config
    from dapo_megatron.plan import format_plan, make_plan, routing_record_bytes
    from tests.e2e.conftest import REPO

    recipe = REPO / "examples/qwen3_30b_a3b/dapo.yaml"
    assert routing_record_bytes(load_config(recipe)) == (0, 0, 0)  # off: nothing recorded
    config = load_config(recipe, ["model.routing_replay=rollout"])
    r, d = config.rollout, config.data
    sequence = 384 * r.n_samples_per_prompt * (r.max_prompt_length + r.max_response_length)
    # Three copies of the kept batch live at once (see routing_record_bytes), one of the round.
    expected = (384, sequence * (3 * d.train_batch_size + d.gen_batch_size))
    expected += (3 * sequence * d.train_batch_size // config.parallel.data_parallel_size,)
    assert routing_record_bytes(config) == expected
    assert "routing records (model.routing_replay=rollout): 384 bytes per token" in format_plan(
        make_plan(config, suggest=False)
    )
