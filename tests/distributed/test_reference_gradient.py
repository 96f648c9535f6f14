"""The actor's whole DAPO update against an implementation that shares nothing with it.

Every other actor test compares the actor with itself (one layout against another, dp2
against dp1). Here one rollout step of the Megatron actor (two mini-batches, several
micro-batches per rank, the distributed optimizer) is compared with transformers' own
model of the family (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) on the same weights in float64, under a DAPO loss written out below
in plain PyTorch: the token mean over every loss token of the whole mini-batch. The first
mini-batch is checked at the initial weights (on-policy: ratio exactly 1), the second at
the weights the actor's first update produced (off-policy: ratios away from 1, some of
them clipped), so the clip, the global token count and the gradient reduction over
micro-batches, pipeline stages, tensor-parallel shards and data-parallel ranks are all
checked against an independent number.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dapo_megatron.ckpt.mapping import fused_expert_view
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import reference_worker
from tests.distributed.actor_worker import tiny_hf_model, tiny_hf_qwen2

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # the actor's defaults (AlgorithmConfig)
RELATIVE_TOLERANCE = 1e-5
SEEDS = {"qwen2": 3, "qwen3": 3, "qwen3_moe": 5}


def _randomize_biases(model) -> None:
    """Biases (Qwen2) and norm weights (q/k norms in Qwen3) away from their initial 0 and 1,
    so a mapping mistake in them cannot hide."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.1)
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # routing far from ties, so fp32 and fp64 pick the same experts
                gate.weight.normal_(0, 1.0)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)


def _float64_model(hf_dir, tied: bool, weights: dict[str, torch.Tensor] | None):
    from transformers import AutoModelForCausalLM

    # Eager attention and experts (the grouped-GEMM experts have no float64 kernel).
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    if weights is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                target = params[name] if name in params else fused_expert_view(params, name)
                target.copy_(value.double())
        assert set(weights) == set(_by_checkpoint_name(params)) - ({"lm_head.weight"} if tied else set())
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _by_checkpoint_name(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's parameters (or their gradients) under the checkpoint's names:
    fused experts (transformers 5) split into each expert's gate, up and down."""
    named = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(tensor.shape[0]):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    key = f"{prefix}.{e}.{proj}.weight"
                    view = fused_expert_view(tensors, key)
                    if view is not None:
                        named[key] = view
        else:
            named[name] = tensor
    return named


def _log_probs(model, tokens: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's log-prob under ``model``; with ``experts`` (``[rows, seq, moe_layers,
    k]``), its routers take those experts (:func:`_replaying`)."""
    with _replaying(model, experts):
        logits = model(input_ids=tokens).logits  # [rows, seq, vocab], float64
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


@contextlib.contextmanager
def _replaying(model, experts: torch.Tensor | None):
    """transformers' MoE routers (``mlp.gate``) made to route every token to the given
    experts, their weights the softmax of the router's logits renormalised over them
    (HF's ``norm_topk_prob``), as megatron's replay gathers its scores."""
    if experts is None:
        yield
        return
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == experts.shape[2]

    def replayed(gate, ordinal):
        def forward(hidden_states):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            indices = experts[:, :, ordinal].reshape(-1, experts.shape[-1])
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return forward

    for ordinal, gate in enumerate(gates):
        gate.forward = replayed(gate, ordinal)
    try:
        yield
    finally:
        for gate in gates:
            del gate.forward


def _kl(log_probs: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """The KL estimators written out: k1 = log p - log q; k3 = q/p - log(q/p) - 1."""
    if kind == "k1":
        return log_probs - ref
    ratio = torch.exp(ref - log_probs)
    return ratio - torch.log(ratio) - 1


def _reference_loss(
    model, batch, rows, reference=None, kl_type=None, on_policy=False, replay=True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DAPO's token-level loss over ``rows``, in float64 (plus ``KL_COEF`` x the token mean
    of the KL estimate to the float64 ``reference`` model): returns (loss, ratios, mask).
    ``on_policy``: the old log-probs are the model's own (ratio exactly 1), not the batch's.
    A batch with a routing record is routed by it (``replay``: unless turned off)."""
    tokens = batch.tokens[rows]
    experts = reference_worker.replay_grid(batch)[rows] if batch.routed_experts is not None and replay else None
    log_probs = _log_probs(model, tokens, experts)
    mask = batch.response_mask()[rows][:, 1:].bool()  # targets at positions 1..; none in column 0
    old = log_probs.detach() if on_policy else batch.old_log_probs[rows][:, 1:].double()
    advantages = batch.advantages[rows].double()[:, None].expand_as(log_probs)
    ratio = torch.exp(log_probs - old)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    if batch.token_weights is not None:  # the rollout correction: constants; the count below is unchanged
        per_token = per_token * batch.token_weights[rows][:, 1:].double()
    loss = per_token[mask].sum() / mask.sum()
    if reference is not None:
        with torch.no_grad():
            ref = _log_probs(reference, tokens)
        loss = loss + reference_worker.KL_COEF * _kl(log_probs, ref, kl_type)[mask].sum() / mask.sum()
    return loss, ratio.detach()[mask], mask


def _merged(saved: list[dict], key: str, index: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for stage in saved:
        assert not set(stage[key][index]) & set(merged)
        merged.update(stage[key][index])
    return merged


@pytest.mark.parametrize(
    (
        "family",
        "tp_size",
        "pp_size",
        "dp_size",
        "weighted",
        "kl_type",
        "ep_size",
        "mlp_only_layers",
        "observed",
        "replay",
    ),
    [
        ("qwen2", 2, 2, 1, False, None, 1, (), True, False),
        ("qwen2", 1, 2, 2, False, None, 1, (), True, False),
        ("qwen2", 2, 1, 2, True, None, 1, (), False, False),
        ("qwen2", 1, 2, 2, False, "k3", 1, (), False, False),
        ("qwen2", 2, 1, 2, False, "k1", 1, (), False, False),
        ("qwen3", 2, 1, 1, False, None, 1, (), True, False),
        ("qwen3", 1, 2, 1, False, None, 1, (), True, False),
        ("qwen3_moe", 1, 1, 2, False, None, 2, (), True, True),
        ("qwen3_moe", 2, 1, 2, False, None, 2, (), False, True),
        ("qwen3_moe", 1, 2, 2, False, None, 2, (1,), False, False),
    ],
    ids=[
        "tp2-pp2-observations",
        "pp2-dp2-observations",
        "tp2-dp2-rollout-correction",
        "pp2-dp2-kl-k3",
        "tp2-dp2-kl-k1",
        "qwen3-tp2-observations",
        "qwen3-pp2-observations",
        "qwen3moe-ep2-dp2-observations-routing-replay",
        "qwen3moe-tp2-ep2-dp2-routing-replay",
        "qwen3moe-dense-layer-pp2-ep2-dp2",
    ],
)
def test_dapo_gradients_equal_an_independent_float64_reference(
    tmp_path, family, tp_size, pp_size, dp_size, weighted, kl_type, ep_size, mlp_only_layers, observed, replay
):
    """With ``weighted``, the batch carries rollout-correction weights (TIS values, some
    capped, and MIS zeros) that the reference multiplies into its token losses. With
    ``kl_type``, the loss adds the KL penalty to a reference policy that is another model
    (so the penalty and its gradient are not zero at the first update). Qwen3: q/k norms
    (their gradients summed over tensor-parallel ranks) and a head width that is not
    hidden / heads. Qwen3-MoE: transformers' ``Qwen3MoeForCausalLM`` (routing, top-k
    renormalisation, experts) with the experts split over ``ep_size`` ranks, tokens
    exchanged by megatron's all-to-all on gloo; the experts' gradients are reduced over
    the expert-data-parallel group, not the data-parallel one; with ``mlp_only_layers``,
    dense layers among the MoE ones (megatron's per-layer specs and checkpoint keys), here
    over two pipeline stages. With ``observed``, the batch holds observation tokens of
    multi-turn episodes (``rollout.env``): in the context, out of the loss and its token
    count; the reference that trains them too is far from the actor (the negative control).
    With ``replay``, rollout routing replay: the batch carries a routing record of random
    experts (not what any router picks), which the float64 model is given too; the float64
    model routing on its own is far from the actor (the negative control)."""
    for tied in (False, True):
        # (Seeds for which no off-policy ratio sits within 1e-4 of a clip boundary.)
        dense = {"mlp_only_layers": list(mlp_only_layers)} if mlp_only_layers else {}
        model = tiny_hf_model(family, tied, seed=SEEDS[family] + tied, attn_implementation="eager", **dense)
        _randomize_biases(model)
        model.save_pretrained(tmp_path / f"hf_tied{int(tied)}")
        if kl_type is not None:
            other = tiny_hf_model(family, tied, seed=30 + tied, attn_implementation="eager")
            _randomize_biases(other)
            other.save_pretrained(tmp_path / f"hf_ref_tied{int(tied)}")
    launch_local(
        reference_worker.dapo_step_with_gradients,
        tp_size * pp_size * dp_size,
        (
            str(tmp_path),
            tp_size,
            pp_size,
            dp_size,
            weighted,
            False,
            kl_type,
            family,
            ep_size,
            mlp_only_layers,
            observed,
            replay,
        ),
    )
    for tied in (False, True):
        stages = [torch.load(tmp_path / f"ref_tied{int(tied)}_stage{s}.pt") for s in range(pp_size)]
        batch = torch.load(tmp_path / f"ref_batch_tied{int(tied)}.pt", weights_only=False)
        if weighted:
            weights = batch.token_weights[batch.response_mask().bool()]
            assert (weights == 0).any() and (weights == 1.3).any() and ((weights > 0) & (weights < 1)).any()
        # Packed (the default), a data-parallel rank's four sequences of a mini-batch fill
        # one or two rows of the budget of 24.
        micro_batches = 2 if dp_size == 1 else 1
        _assert_step_matches_float64(tmp_path, stages, batch, f"hf_tied{int(tied)}", tied, kl_type, micro_batches)
        if observed:
            holes = (batch.response_mask() == 0) & (batch._response_region() == 1)
            assert int(holes.sum()) == 2 * sum(int(n) >= 5 for n in batch.response_lengths)
            _assert_training_observations_is_far(tmp_path, stages, batch, f"hf_tied{int(tied)}", tied)
        if replay:
            # Every position that predicts a loss token is replayed (the last token, which
            # the engine never fed, predicts none).
            assert all(m["moe_replayed_share"] == 1.0 for m in stages[-1]["metrics"])
            assert all(m["moe_routing_changed_engine"] == 0.0 for m in stages[-1]["metrics"])
            _assert_routing_on_its_own_is_far(tmp_path, stages, batch, f"hf_tied{int(tied)}", tied)


def _assert_routing_on_its_own_is_far(tmp_path, stages, batch, hf_folder, tied) -> None:
    """Negative control: the float64 reference of the first mini-batch routing on its own
    (not replaying the batch's record) is far from the actor's loss and gradients."""
    rows = list(range(batch.num_rows // reference_worker.NUM_MINI_BATCHES))
    model = _float64_model(tmp_path / hf_folder, tied, None)
    loss, _, _ = _reference_loss(model, batch, rows, on_policy=True, replay=False)
    loss.backward()
    actor_gradients = _merged(stages, "gradients", 0)
    reference = _by_checkpoint_name({name: p.grad for name, p in model.named_parameters()})
    errors = [float((actor_gradients[n].double() - g).norm() / g.norm()) for n, g in reference.items()]
    assert max(errors) > 1e3 * RELATIVE_TOLERANCE, max(errors)


def _assert_training_observations_is_far(tmp_path, stages, batch, hf_folder, tied) -> None:
    """Negative control: the float64 reference of the first mini-batch trained on the
    observation tokens too (the batch without its loss mask) is far from the actor's loss
    and gradients, which the test above found within its tolerance of the masked one."""
    unmasked = batch.select(list(range(batch.num_rows)))
    unmasked.loss_mask = None
    rows = list(range(batch.num_rows // reference_worker.NUM_MINI_BATCHES))
    model = _float64_model(tmp_path / hf_folder, tied, None)
    loss, _, _ = _reference_loss(model, unmasked, rows)
    loss.backward()
    metrics = stages[-1]["metrics"][0]
    assert abs(metrics["loss"] - loss.item()) > 1e3 * RELATIVE_TOLERANCE * max(1.0, abs(loss.item()))
    actor_gradients = _merged(stages, "gradients", 0)
    reference = _by_checkpoint_name({name: p.grad for name, p in model.named_parameters()})
    errors = [float((actor_gradients[n].double() - g).norm() / g.norm()) for n, g in reference.items()]
    assert max(errors) > 1e3 * RELATIVE_TOLERANCE, max(errors)


def _assert_step_matches_float64(tmp_path, stages, batch, hf_folder, tied, kl_type=None, micro_batches=2) -> None:
    """The actor's step (``stages``: what each pipeline stage saved, each update over at
    least ``micro_batches`` micro-batches) against the float64 model: each mini-batch's
    loss and gradients within ``RELATIVE_TOLERANCE``."""
    metrics = stages[-1]["metrics"]
    assert len(metrics) == reference_worker.NUM_MINI_BATCHES
    assert all(m["num_micro_batches"] >= micro_batches for m in metrics)
    # On-policy, the first mini-batch's ratio is exactly 1: old and new log-probs are
    # the same computation (the same micro-batches, shapes and order) on the same weights.
    assert metrics[0]["ratio_mean"] == 1.0 and metrics[0]["ratio_max"] == 1.0, metrics[0]
    assert metrics[0]["pg_clipfrac_low"] == metrics[0]["pg_clipfrac_high"] == 0.0
    rows_per_mini = batch.num_rows // reference_worker.NUM_MINI_BATCHES
    hf_dir = tmp_path / hf_folder
    for index in range(reference_worker.NUM_MINI_BATCHES):
        actor_gradients = _merged(stages, "gradients", index)
        # Mini-batch k is taken at the weights the actor had before its update k.
        weights = None if index == 0 else _merged(stages, "weights_after", index - 1)
        model = _float64_model(hf_dir, tied, weights)
        rows = list(range(index * rows_per_mini, (index + 1) * rows_per_mini))
        reference = None
        if kl_type is not None:
            reference = _float64_model(tmp_path / hf_folder.replace("hf_", "hf_ref_"), tied, None)
            with torch.no_grad():
                ref_kl, _, mask = _reference_loss(model, batch, rows, reference, kl_type)
                pg_only, _, _ = _reference_loss(model, batch, rows)
            kl_mean = (ref_kl - pg_only).item() / reference_worker.KL_COEF
            assert abs(kl_mean) > 1e-2 and abs(metrics[index]["kl_loss"] - kl_mean) <= 1e-5 * max(1.0, abs(kl_mean))
        loss, ratios, _ = _reference_loss(model, batch, rows, reference, kl_type)
        loss.backward()
        assert abs(metrics[index]["loss"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
        if index == 0:
            assert (ratios - 1).abs().max() < 1e-5
        else:
            # Off-policy now, and some tokens are clipped; none sits so close to a clip
            # boundary that fp32 and fp64 could fall on different sides of it.
            clipped = (ratios < 1 - CLIP_LOW) | (ratios > 1 + CLIP_HIGH)
            assert clipped.any() and (ratios - 1).abs().max() > 0.05
            boundary = torch.minimum((ratios - (1 - CLIP_LOW)).abs(), (ratios - (1 + CLIP_HIGH)).abs())
            assert boundary.min() > 1e-4
        reference = _by_checkpoint_name({name: p.grad for name, p in model.named_parameters()})
        assert sorted(actor_gradients) == sorted(reference)
        for name, expected in reference.items():
            got = actor_gradients[name].double()
            error = (got - expected).norm() / expected.norm()
            assert error <= RELATIVE_TOLERANCE, (tied, index, name, float(error))


PACKED_TOLERANCE = 1e-6
"""Packed against padded rows (both fp32): only the order of float additions differs
(longer softmax and GEMM rows, with exact zeros where the mask removes a token)."""


@pytest.mark.parametrize(
    ("tp_size", "pp_size", "dp_size"), [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"]
)
def test_packed_sequences_equal_padded_rows_and_the_float64_reference(tmp_path, tp_size, pp_size, dp_size):
    """One rollout step from the same weights with padded rows and with packed sequences
    (a row filled exactly to the budget, rows of a single sequence, rows of two): the old
    log-probs and the first update's gradients agree within 1e-6, and the packed step
    matches the float64 model as the padded one does (both mini-batches, 1e-5)."""
    model = tiny_hf_model("qwen2", False, seed=SEEDS["qwen2"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    launch_local(
        reference_worker.packed_and_unpacked_steps,
        tp_size * pp_size * dp_size,
        (str(tmp_path), tp_size, pp_size, dp_size),
    )
    runs = {pack: [torch.load(tmp_path / f"pack{pack}_stage{s}.pt") for s in range(pp_size)] for pack in (0, 1)}
    rows = [mb for mini in runs[1][0]["row_lengths"] for mb in mini]  # sequence lengths of each packed row
    assert any(len(mb) == 1 for mb in rows) and any(len(mb) >= 2 for mb in rows), rows
    if dp_size == 1:
        assert [13, 11] in rows, rows  # exactly the budget of 24: the last sequence ends at the row's end
    assert all(sum(mb) <= 24 for mb in rows)
    # Attention per segment: the largest score tensor is [heads, longest sequence, its
    # length] (no square as wide as a packed row, whose width reaches 24).
    longest = max(max(mb) for mb in rows)
    assert longest < max(sum(mb) for mb in rows) or dp_size > 1  # (data-parallel rank 0: [20], [9], [13, 7])
    for stage in runs[1]:
        assert stage["attention_scores_numel"] == (4 // tp_size) * longest**2
    batches = {pack: torch.load(tmp_path / f"pack{pack}_batch.pt", weights_only=False) for pack in (0, 1)}
    mask = batches[0].response_mask().bool()
    assert float((batches[1].old_log_probs - batches[0].old_log_probs)[mask].abs().max()) <= PACKED_TOLERANCE
    padded, packed = _merged(runs[0], "gradients", 0), _merged(runs[1], "gradients", 0)
    for name, expected in padded.items():
        error = float((packed[name].double() - expected.double()).norm() / expected.double().norm())
        assert error <= PACKED_TOLERANCE, (name, error)
    # (Packed, a data-parallel rank's two sequences of a mini-batch may share one row.)
    _assert_step_matches_float64(tmp_path, runs[1], batches[1], "hf_tied0", tied=False, micro_batches=1)


def test_packed_sequences_that_see_their_neighbour_are_far_from_padded_rows(tmp_path):
    """The packed test can fail: with segments that let each second sequence of a row also
    attend to the one before it, the old log-probs are more than 1e-3 from the padded rows'."""
    model = tiny_hf_model("qwen2", False, seed=SEEDS["qwen2"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    launch_local(reference_worker.packed_and_unpacked_steps, 1, (str(tmp_path), 1, 1, 1, True))
    batches = {pack: torch.load(tmp_path / f"pack{pack}_batch.pt", weights_only=False) for pack in (0, 1)}
    mask = batches[0].response_mask().bool()
    assert float((batches[1].old_log_probs - batches[0].old_log_probs)[mask].abs().max()) > 1e-3


def test_first_ratio_is_exactly_one_whatever_the_gemm_kernels(tmp_path):
    """The first update's ratio is 1 by construction, not by a BLAS whose row results do
    not depend on the row count: under GEMMs that scale their output by the number of
    rows (:class:`reference_worker.RowCountDependentGemms`), at the layouts that failed on
    an AMD EPYC machine, the ratio is still exactly 1. (Old log-probs computed over the
    whole batch, not in the updates' micro-batches, give 1.0000001 here.)"""
    for tied in (False, True):
        tiny_hf_qwen2(tied, seed=3 + tied, attn_implementation="eager").save_pretrained(
            tmp_path / f"hf_tied{int(tied)}"
        )
    launch_local(reference_worker.dapo_step_with_gradients, 4, (str(tmp_path), 1, 2, 2, False, True))
    for tied in (0, 1):
        metrics = torch.load(tmp_path / f"ref_tied{tied}_stage1.pt")["metrics"]
        assert metrics[0]["ratio_mean"] == 1.0 and metrics[0]["ratio_max"] == 1.0, metrics[0]
        assert metrics[1]["ratio_max"] > 1.0  # the second update is off-policy


def _control_errors(tmp_path) -> dict[str, float]:
    """Each control's largest log-prob error against the float64 model in ``hf_tied0``."""
    got = torch.load(tmp_path / "controls.pt")
    batch = reference_worker.reference_batch()
    with torch.no_grad():
        expected = _log_probs(_float64_model(tmp_path / "hf_tied0", False, None), batch.tokens)
    mask = batch.response_mask()[:, 1:].bool()
    return {name: float((lp[:, 1:].double() - expected)[mask].abs().max()) for name, lp in got.items()}


def test_qwen3_without_its_qk_norms_is_far_from_the_reference(tmp_path):
    """The Qwen3 reference test can fail: with its q/k norms (randomised away from 1 by
    the test) the actor's log-probs are within 1e-5 of the float64 ``Qwen3ForCausalLM``;
    with them left at 1 they are more than 1e-3 away."""
    model = tiny_hf_model("qwen3", False, seed=SEEDS["qwen3"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    launch_local(reference_worker.qwen3_log_probs_without_qk_norms, 1, (str(tmp_path),))
    errors = _control_errors(tmp_path)
    assert errors["right"] <= 1e-5 and errors["without_qk_norms"] > 1e-3, errors


def test_moe_negative_controls_are_far_from_the_reference(tmp_path):
    """The MoE reference test can fail: at ep 2 x dp 2 the actor's log-probs equal the
    float64 ``Qwen3MoeForCausalLM``'s within 1e-5, while a router that does not renormalise
    its top-k (the wrong ``norm_topk_prob``) and two swapped experts of one layer are each
    more than 1e-3 away."""
    model = tiny_hf_model("qwen3_moe", False, seed=SEEDS["qwen3_moe"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    with torch.no_grad():
        for fused in (model.model.layers[1].mlp.experts.gate_up_proj, model.model.layers[1].mlp.experts.down_proj):
            fused[[0, 2]] = fused[[2, 0]].clone()
    model.save_pretrained(tmp_path / "hf_swapped")
    launch_local(reference_worker.moe_log_probs_of_controls, 2, (str(tmp_path), 2))
    errors = _control_errors(tmp_path)
    assert errors["right"] <= 1e-5 and errors["wrong_norm_topk_prob"] > 1e-3 and errors["swapped"] > 1e-3, errors


def test_the_actor_reports_routing_that_differs_from_the_engines_and_replays_it(tmp_path):
    """The record of transformers' own routing of each row (what the transformers engine
    returns) under ``measure``: the actor routes every position as it does (0 changed:
    the record's positions are the actor's). A record of random experts: under
    ``measure`` most positions routed elsewhere (two random experts of four match a
    router's top-2 one time in six), under ``rollout`` replayed (0, in every update), every
    position that predicts a loss token; with one row's record cut short, the share of
    those positions replayed is what the record covers."""
    model = tiny_hf_model("qwen3_moe", False, seed=SEEDS["qwen3_moe"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    launch_local(reference_worker.routing_against_a_record, 1, (str(tmp_path),))
    own, measured, replayed, short = (
        torch.load(tmp_path / f"routing_{case}.pt", weights_only=False)
        for case in ("own", "measure", "rollout", "short")
    )
    assert own["metrics"][0]["moe_routing_changed_engine"] == 0.0
    assert all(0.5 < update["moe_routing_changed_engine"] < 1.0 for update in measured["metrics"])
    assert "moe_replayed_share" not in measured["metrics"][0]
    assert all(update["moe_routing_changed_engine"] == 0.0 for update in replayed["metrics"])
    assert all(update["moe_routing_changed"] == 0.0 for update in replayed["metrics"])
    assert replayed["metrics"][0]["moe_replayed_share"] == 1.0
    batch = short["batch"]
    rows = batch.num_rows // reference_worker.NUM_MINI_BATCHES
    mask = batch.response_mask()[:rows]
    predicted_from = torch.arange(mask.shape[1]) - 1  # the position each token's log-prob is computed at
    covered = (predicted_from[None, :] < batch.routed_lengths[:rows, None]).double()
    expected = float((mask * covered).sum() / mask.sum())
    assert expected < 1.0 and short["metrics"][0]["moe_replayed_share"] == pytest.approx(expected, abs=1e-12)


BF16_UNIT_ROUNDOFF = 2.0**-9
"""bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-9 of it."""
BF16_ROUNDINGS = 2 * 4 * 12
"""bf16 roundings on a gradient's path through the tiny model: forward and backward (2),
through its 4 layers, about 12 per layer each way (norm, q, k, v, scores, probabilities,
attention output, projection, residual, norm, fc1 and its activation, fc2, residual)."""
BF16_TOLERANCE = 4 * BF16_ROUNDINGS**0.5 * BF16_UNIT_ROUNDOFF / 3**0.5
"""The relative gradient error bf16 may have against float64: independent rounding errors
(uniform, rms ``u / sqrt(3)``) add in quadrature over ``BF16_ROUNDINGS`` roundings, ~1.1e-2;
four times that (4.4e-2) leaves room for errors that align. A mistake in what is computed
(a dropped micro-batch, another mini-batch's rows, a wrong token count) moves a gradient
by tens of percent."""


@pytest.mark.parametrize(("tp_size", "dp_size"), [(2, 1), (1, 2)], ids=["tp2", "dp2"])
def test_bf16_gradients_are_within_the_bf16_tolerance_of_the_float64_reference(tmp_path, tp_size, dp_size):
    """The first (on-policy) DAPO update of a bf16 actor (megatron's Float16Module, fp32
    main parameters and gradient buffers in the distributed optimizer, packed sequences)
    against the float64 model on the same weights, bf16-representable: every gradient
    within BF16_TOLERANCE, while the gradients of the other mini-batch's rows are far
    outside it (the tolerance tells a wrong computation apart)."""
    model = tiny_hf_model("qwen2", False, seed=SEEDS["qwen2"], attn_implementation="eager")
    _randomize_biases(model)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    model.save_pretrained(tmp_path / "hf_bf16")
    launch_local(reference_worker.bf16_step, tp_size * dp_size, (str(tmp_path), tp_size, 1, dp_size))
    saved = torch.load(tmp_path / "bf16_stage0.pt")
    batch = torch.load(tmp_path / "bf16_batch.pt", weights_only=False)
    assert saved["metrics"][0]["ratio_max"] == 1.0 and saved["metrics"][0]["nonfinite"] == 0.0
    size = batch.num_rows // reference_worker.NUM_MINI_BATCHES

    def reference_gradients(rows):
        model = _float64_model(tmp_path / "hf_bf16", False, None)
        loss, _, _ = _reference_loss(model, batch, rows, on_policy=True)
        loss.backward()
        return _by_checkpoint_name({n: p.grad for n, p in model.named_parameters()})

    def largest_error(expected_by_name):
        actor = saved["gradients"][0]
        assert sorted(actor) == sorted(expected_by_name)
        return max(
            float((actor[name].double() - expected).norm() / expected.norm())
            for name, expected in expected_by_name.items()
        )

    error = largest_error(reference_gradients(list(range(size))))
    assert 1e-4 < error <= BF16_TOLERANCE, error  # bf16's error, not fp32's, and within the bound
    assert largest_error(reference_gradients(list(range(size, 2 * size)))) > 10 * BF16_TOLERANCE
