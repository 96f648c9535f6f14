"""Qwen2 / Qwen2.5: a Llama-style decoder whose only bias is on the q, k and v
projections, with head width ``hidden_size / num_attention_heads``."""

from dapo_megatron.families import ModelFamily

FAMILY = ModelFamily(model_type="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False)
