"""Qwen3-MoE through the system at expert parallelism: a converted checkpoint loads at
ep 2, feeds a transformers engine bitwise, trains with the load-balancing loss on, and
its trainer checkpoint moves between ep 2 and ep 1 with nothing lost."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dapo_megatron.ckpt.convert import hf_to_megatron, megatron_to_hf
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import moe_worker
from tests.distributed.actor_worker import tiny_hf_model
from tests.distributed.reference_worker import reference_batch
from tests.distributed.test_reference_gradient import SEEDS, _float64_model, _log_probs, _randomize_biases


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("moe")
    model = tiny_hf_model("qwen3_moe", False, seed=SEEDS["qwen3_moe"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(workdir / "hf")
    report = hf_to_megatron(workdir / "hf", workdir / "mg", verify=True, progress=False)
    assert report.verified and report.max_logit_error < 1e-5
    # ep 2 x dp 2 from the converted weights; its checkpoint at ep 1; that one back at ep 2.
    launch_local(moe_worker.load_sync_train_save, 2, (str(workdir), 1, 2, 2, "mg", "ep2"))
    launch_local(moe_worker.load_sync_train_save, 1, (str(workdir), 1, 1, 1, "ckpt_ep2", "ep1"))
    # (No test reads the checkpoints of these last two runs: they are not written.)
    launch_local(moe_worker.load_sync_train_save, 2, (str(workdir), 1, 2, 2, "ckpt_ep1", "back_at_ep2", False))
    # The converted weights again, at tp 2 x ep 2 x dp 2 (sequence parallel).
    launch_local(moe_worker.load_sync_train_save, 4, (str(workdir), 2, 2, 2, "mg", "tp2", False))
    return workdir


def test_converted_moe_checkpoint_at_ep2_gives_transformers_log_probs(moe_run):
    got = torch.load(moe_run / "ep2.pt", weights_only=False)
    batch = reference_batch()
    with torch.no_grad():
        expected = _log_probs(_float64_model(moe_run / "hf", False, None), batch.tokens)
    mask = batch.response_mask()[:, 1:].bool()
    assert float((got["before"][:, 1:].double() - expected)[mask].abs().max()) <= 1e-5


def test_engine_weights_equal_the_export_bitwise_at_ep2(moe_run):
    """Before training the engine holds the HF checkpoint itself; after a step, what the
    converter exports from the ep-2 trainer checkpoint. Experts arrive under their HF
    names (``mlp.experts.{e}.gate_proj``), into transformers' fused expert parameters."""
    got = torch.load(moe_run / "ep2.pt", weights_only=False)
    original = _hf_tensors(moe_run / "hf")
    assert any(".mlp.experts.3.down_proj.weight" in name for name in original)
    assert sorted(got["engine_before"]) == sorted(original)
    assert all(torch.equal(got["engine_before"][name], tensor) for name, tensor in original.items())
    megatron_to_hf(got["checkpoint"], moe_run / "hf", moe_run / "exported", verify=True, progress=False)
    exported = _hf_tensors(moe_run / "exported")
    assert sorted(got["engine_after"]) == sorted(exported)
    changed = [name for name in exported if not torch.equal(exported[name], original[name])]
    assert any(".mlp.experts." in name for name in changed) and any(".mlp.gate." in name for name in changed)
    for name, tensor in exported.items():
        assert torch.equal(got["engine_after"][name], tensor), name


def test_trainer_checkpoints_move_between_ep2_and_ep1(moe_run):
    """The ep-1 run resumes the ep-2 run's checkpoint: its log-probs equal those the ep-2
    run had after its step; the run back at ep 2 resumes the ep-1 one's the same way.
    Each run's step is a real update with the load-balancing loss on."""
    ep2, ep1, back = (torch.load(moe_run / f"{tag}.pt", weights_only=False) for tag in ("ep2", "ep1", "back_at_ep2"))
    mask = reference_batch().response_mask().bool()
    assert float((ep1["before"] - ep2["after"])[mask].abs().max()) <= 1e-5
    assert float((back["before"] - ep1["after"])[mask].abs().max()) <= 1e-5
    for run in (ep2, ep1, back):
        assert float((run["after"] - run["before"])[mask].abs().max()) > 1e-3  # it trained


def test_routing_metrics_of_each_update(moe_run):
    """The first update is on-policy: its routing is the old-log-prob pass's, token for
    token (0 changed); the second runs on weights the first changed. The load-balancing
    loss is megatron's (about 1 for balanced routing, at most the number of experts);
    an expert never receives fewer tokens than the mean times 0 or more than all."""
    for tag in ("ep2", "ep1", "back_at_ep2"):
        first, second = torch.load(moe_run / f"{tag}.pt", weights_only=False)["metrics"]
        assert first["moe_routing_changed"] == 0.0
        assert 0.0 < second["moe_routing_changed"] < 1.0  # lr 1e-2 moves routing a lot
        for update in (first, second):
            assert 0.5 < update["moe_load_balancing_loss"] < 4.0
            assert (
                1.0
                <= update["moe_tokens_per_expert_max_over_mean"]
                <= update["moe_tokens_per_expert_max_over_mean_worst_layer"]
                <= 4.0
            )


@pytest.mark.parametrize(
    ("family", "tp_size", "ep_size", "dp_size"), [("qwen3", 2, 1, 1), ("qwen3_moe", 1, 2, 2), ("qwen3_moe", 2, 2, 2)]
)
def test_both_families_sync_into_the_engine_bitwise_by_buckets_and_by_pieces(
    tmp_path, family, tp_size, ep_size, dp_size
):
    """Loaded straight from HF safetensors and sent back, the weights arrive unchanged:
    Qwen3's q/k norms (whole, from tensor-parallel rank 0) at tp 2, and Qwen3-MoE's experts
    at ep 2 x dp 2 (half of each layer's experts sit in the other replica) and at
    tp 2 x ep 2 x dp 2 (the expert-parallel group is the tensor-parallel one)."""
    model = tiny_hf_model(family, False, seed=SEEDS[family], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf")
    launch_local(moe_worker.sync_both_ways, tp_size * dp_size, (str(tmp_path), family, tp_size, ep_size, dp_size))
    got = torch.load(tmp_path / f"sync_{family}.pt")
    original = _hf_tensors(tmp_path / "hf")
    for way in ("buckets", "pieces"):
        assert sorted(got[way]) == sorted(original), way
        for name, tensor in original.items():
            assert torch.equal(got[way][name], tensor), (way, name)


def test_routing_metrics_do_not_depend_on_the_layout(moe_run):
    """The same weights and batch at ep 2 x dp 2 and at tp 2 x ep 2 x dp 2 (each
    tensor-parallel rank routing its part of the sequence): the first update's metrics
    agree, the load-balancing loss being summed over those parts, not averaged (a mean
    would halve it). Under sequence parallelism rows are padded to a multiple of tp; the
    padding mask the actor gives megatron keeps padding out of the router losses, so the
    loss, and with it the gradient, agree to float rounding."""
    ep2, tp2 = (torch.load(moe_run / f"{tag}.pt", weights_only=False)["metrics"][0] for tag in ("ep2", "tp2"))
    assert tp2["moe_routing_changed"] == 0.0
    for name in ("moe_tokens_per_expert_max_over_mean", "moe_tokens_per_expert_max_over_mean_worst_layer"):
        assert tp2[name] == ep2[name], name
    assert abs(tp2["moe_load_balancing_loss"] - ep2["moe_load_balancing_loss"]) <= 1e-6 * ep2["moe_load_balancing_loss"]
    assert (
        abs(tp2["loss"] - ep2["loss"]) <= 1e-6 and abs(tp2["grad_norm"] - ep2["grad_norm"]) <= 1e-5 * ep2["grad_norm"]
    )


@pytest.mark.parametrize("replay", [False, True], ids=["own-routing", "routing-replay"])
def test_router_losses_under_recompute_at_pp2_equal_those_without(tmp_path, replay):
    """pp 2 x dp 2 x ep 2, full recompute: 1F1B runs stage 0's backward of micro-batch 1
    (whose router losses attach in that backward's recompute) after the forward of
    micro-batch 2, a filler on data-parallel rank 1. The router losses' coefficients must
    be micro-batch 1's when the recompute reads them, and so must the experts it replays
    (``replay``: rollout routing replay of a random record, which the recompute would get
    wrong from another micro-batch's experts): every gradient and the load-balancing
    metric equal those of the same step without recompute."""
    model = tiny_hf_model("qwen3_moe", False, seed=SEEDS["qwen3_moe"], attn_implementation="eager")
    model.save_pretrained(tmp_path / "hf")
    for recompute in (False, True):
        launch_local(moe_worker.router_losses_at_pp2, 4, (str(tmp_path), recompute, replay))

    def saved(recompute, pp, dp):
        return torch.load(tmp_path / f"router_{recompute}_pp{pp}_dp{dp}.pt", weights_only=False)

    # The premise: rank 1's shard packs into fewer micro-batches, padded with a filler.
    real = [[len([mb for mb in m if mb]) for m in saved(True, 0, dp)["row_lengths"]] for dp in (0, 1)]
    assert real == [[3, 3], [2, 2]] and [len(m) for m in saved(True, 0, 1)["row_lengths"]] == [3, 3]
    metrics = saved(False, 1, 0)["metrics"]
    assert all(m["moe_load_balancing_loss"] > 0 for m in metrics)
    if replay:
        assert all(m["moe_routing_changed_engine"] == 0.0 for m in saved(True, 1, 0)["metrics"])
    for got, expected in zip(saved(True, 1, 0)["metrics"], metrics):
        assert got["moe_load_balancing_loss"] == pytest.approx(expected["moe_load_balancing_loss"], rel=1e-6)
    for stage in (0, 1):
        with_recompute, without = saved(True, stage, 0), saved(False, stage, 0)
        for update, (got, expected) in enumerate(zip(with_recompute["gradients"], without["gradients"])):
            assert sorted(got) == sorted(expected)
            assert any("router" in name or "gate.weight" in name for name in expected)
            for name, value in expected.items():
                error = (got[name] - value).norm() / value.norm().clamp(min=1e-30)
                assert error <= 1e-6, (stage, update, name, float(error))
