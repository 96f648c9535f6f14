"""An MoE layer's pre-MLP norm has one checkpoint name under every layer spec."""

from __future__ import annotations

import dataclasses

import pytest


def test_moe_layers_get_the_local_specs_norm_key_and_dense_layers_are_left_alone():
    """megatron's local spec maps ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``;
    its Transformer Engine spec (not installable here) keeps the TE op-fuser names only.
    Stripped of its map, as the TE spec's MoE layer is, a layer gets the mapping back, the
    map it had is kept, and a dense layer or a block of layers is handled too."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from dapo_megatron.models.gpt import MOE_NORM_KEY, with_moe_norm_keys

    moe = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    as_te = dataclasses.replace(
        moe, submodules=dataclasses.replace(moe.submodules, sharded_state_dict_keys_map={"mlp.0.": "x"})
    )
    assert with_moe_norm_keys(as_te).submodules.sharded_state_dict_keys_map == {"mlp.0.": "x", **MOE_NORM_KEY}
    dense = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    assert with_moe_norm_keys(dense) is dense
    block = with_moe_norm_keys(TransformerBlockSubmodules(layer_specs=[as_te, dense]))
    assert (
        block.layer_specs[0].submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."]
        == "mlp.linear_fc1.layer_norm_"
    )
    assert block.layer_specs[1] is dense


def _tiny_moe_model(**settings):
    from dapo_megatron.config import ModelConfig

    return ModelConfig(
        family="qwen3_moe",
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **settings,
    )


def _z_loss_calls(config, monkeypatch) -> int:
    """How many times megatron's router computes the z-loss for one training forward
    under ``config`` (its own ``apply_z_loss``, with the loss function counted)."""
    import types

    import torch
    from megatron.core.transformer.moe import router as megatron_router

    calls = []

    def counted(logits, coeff, padding_mask=None):
        calls.append(coeff)
        return torch.logsumexp(logits, -1).square().mean() * coeff

    monkeypatch.setattr(megatron_router, "z_loss_func", counted)
    monkeypatch.setattr(megatron_router, "save_to_aux_losses_tracker", lambda *args, **kwargs: None)
    fake_router = types.SimpleNamespace(
        config=config,
        training=True,
        tp_cp_group=types.SimpleNamespace(size=lambda: 1),
        calculate_per_token_loss=False,
        layer_number=1,
    )
    logits = torch.randn(6, 4, requires_grad=True)
    megatron_router.TopKRouter.apply_z_loss(fake_router, logits)
    return len(calls)


def test_a_zero_router_loss_coefficient_is_off_in_the_config_megatron_reads(monkeypatch):
    """``model.moe_z_loss_coeff: 0`` means off: megatron's TransformerConfig holds None
    (megatron's test is ``is not None``; 0.0 would compute a logsumexp per layer and
    micro-batch and store z_loss / 0 = NaN in its tracker), also after the routing
    monitor has set the coefficients for real and filler micro-batches of an update.
    A load-balancing coefficient of 0 is off in megatron as 0.0 (its test is ``== 0``)."""
    import torch

    from dapo_megatron.actor import routing
    from dapo_megatron.config import ParallelConfig
    from dapo_megatron.models.gpt import transformer_config

    monkeypatch.setattr(routing.dist, "all_reduce", lambda tensor, group=None: tensor)
    model = _tiny_moe_model(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    config = transformer_config(model, ParallelConfig(device="cpu"), "cpu")
    assert config.moe_z_loss_coeff is None and config.moe_aux_loss_coeff == 0.0
    assert config.moe_router_load_balancing_type == "none"
    gpt = torch.nn.Module()
    gpt.config = config
    monitor = routing.RoutingMonitor(gpt, model, torch.device("cpu"), 0, 1, False)
    tokens, loss_mask = torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4)
    for filler in (False, True):
        monitor.scale_for_update(3, group=None)
        monitor.micro_batch(0, tokens, loss_mask, filler=filler)
        assert config.moe_z_loss_coeff is None, filler
        assert config.moe_aux_loss_coeff == 0.0, filler
        assert _z_loss_calls(config, monkeypatch) == 0
    # Negative control: a coefficient that is set is divided over the update's micro-batches
    # (a filler gets the negligible one) and megatron does compute the z-loss.
    model = _tiny_moe_model(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.6)
    config = transformer_config(model, ParallelConfig(device="cpu"), "cpu")
    gpt.config = config
    monitor = routing.RoutingMonitor(gpt, model, torch.device("cpu"), 0, 1, False)
    monitor.scale_for_update(3, group=None)
    monitor.micro_batch(0, tokens, loss_mask)
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == pytest.approx((0.1, 0.2), rel=1e-12)
    assert _z_loss_calls(config, monkeypatch) == 1
    monitor.micro_batch(1, tokens, loss_mask, filler=True)
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (routing.FILLER_COEFFICIENT,) * 2


def test_the_per_layer_coefficient_gives_hfs_load_balancing_loss_with_megatrons_functions():
    """transformers' Qwen3-MoE ``load_balancing_loss_func`` (pooled over layers, times
    ``router_aux_loss_coef``) against megatron-core's ``switch_load_balancing_loss_func``
    summed over the layers at :func:`hf_aux_loss_per_layer`'s coefficient: the same value
    and the same gradient of the router logits when every layer routes alike (HF pools the
    layers' loads before the product, megatron multiplies each layer's own, so they differ
    otherwise); HF's coefficient used per layer (the old default) weighs it L/k times."""
    import torch
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from dapo_megatron.config.model import hf_aux_loss_per_layer

    layers, experts, topk, tokens, hf_coef = 6, 8, 2, 40, 0.001
    torch.manual_seed(0)
    base = torch.randn(tokens, experts, dtype=torch.float64)

    def hf(logits):
        return hf_coef * load_balancing_loss_func(tuple(logits), experts, topk)

    def megatron(logits, coeff):
        total = 0.0
        for layer_logits in logits:
            routing_map, scores = compute_routing_scores_for_aux_loss(layer_logits, topk, "softmax")
            total = total + switch_load_balancing_loss_func(
                scores, routing_map.sum(dim=0), tokens, topk, experts, coeff
            )
        return total

    coeff = hf_aux_loss_per_layer(hf_coef, True, topk, layers)
    assert coeff == pytest.approx(hf_coef * topk / layers, rel=1e-15)
    a = [base.clone().requires_grad_(True) for _ in range(layers)]
    b = [base.clone().requires_grad_(True) for _ in range(layers)]
    ours, theirs = megatron(a, coeff), hf(b)
    # HF sums the probabilities in fp32: equal to its precision.
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6) and 1e-4 < theirs.item() < 1e-2
    ours.backward()
    theirs.backward()
    for mine, hfs in zip(a, b):
        torch.testing.assert_close(mine.grad, hfs.grad, rtol=1e-4, atol=1e-12)
    # Negative control: HF's coefficient per layer is layers / topk = 3 times HF's weight.
    old = megatron([base] * layers, hf_coef)
    assert old.item() == pytest.approx(theirs.item() * layers / topk, rel=1e-6)
    # HF with output_router_logits off adds no loss at all.
    assert hf_aux_loss_per_layer(hf_coef, False, topk, layers) == 0.0
