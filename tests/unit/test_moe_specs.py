"""An MoE layer's pre-MLP norm has one checkpoint name under every layer spec."""

from __future__ import annotations

import dataclasses


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
