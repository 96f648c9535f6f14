"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no bias,
explicit ``head_dim``) with every MLP replaced by a top-k router over ``num_experts``
experts of width ``moe_intermediate_size`` and no shared expert."""

from dapo_megatron.families import ModelFamily

FAMILY = ModelFamily(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True)
