"""Qwen3 dense (0.6B to 32B): Qwen2's decoder without the q/k/v bias, with a per-head
RMSNorm on queries and keys (``q_norm`` / ``k_norm``) and an explicit ``head_dim`` that
need not be ``hidden_size / num_attention_heads`` (128 throughout the family); the small
models tie their embeddings."""

from dapo_megatron.families import ModelFamily

FAMILY = ModelFamily(model_type="qwen3", architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True)
