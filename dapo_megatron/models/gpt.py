"""Build megatron-core's GPTModel for any supported model family.

The families (``dapo_megatron.families``) are Llama-style decoders that differ in
features this module turns into megatron settings: a bias on the fused QKV projection
(Qwen2), per-head q/k RMSNorm (Qwen3, megatron's ``qk_layernorm``), the head width
(``kv_channels``), experts behind a top-k router (Qwen3-MoE, megatron's MoE layer with
the all-to-all token dispatcher); and, for all, RMSNorm with the checkpoint's epsilon and the RoPE base
of the HF config. A :class:`ModelConfig` (filled from the HF ``config.json``) becomes
megatron's ``TransformerConfig`` and a ``GPTModel`` for this rank's pipeline stage, using
Transformer Engine layer specs on a GPU with TE and megatron's local spec otherwise. The
vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp_size`` as
megatron expects.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import torch.nn.functional as F

from dapo_megatron.config import ModelConfig, ParallelConfig, moe_layers, padded_vocab_size
from dapo_megatron.families import family_named


def params_dtype(model: ModelConfig, device_type: str) -> torch.dtype:
    """Parameter dtype: bf16 on GPU and fp32 on CPU unless the config says otherwise."""
    if model.params_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[model.params_dtype]


def use_transformer_engine(model: ModelConfig, device_type: str) -> bool:
    """Whether to build Transformer Engine layers: requested, or ``auto`` with TE on a GPU."""
    if model.transformer_impl == "local" or device_type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if model.transformer_impl == "transformer_engine":
            raise ImportError(
                "model.transformer_impl=transformer_engine but transformer_engine is not "
                "installed; install the [gpu] extra or set model.transformer_impl=local"
            ) from None
        return False
    return True


def transformer_config(model: ModelConfig, parallel: ParallelConfig, device_type: str):
    """megatron ``TransformerConfig`` for ``model`` (of any family) under ``parallel``."""
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype(model, device_type)
    use_te = use_transformer_engine(model, device_type)
    family = family_named(model.family)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=parallel.tp_size,
        pipeline_model_parallel_size=parallel.pp_size,
        context_parallel_size=parallel.cp_size,
        sequence_parallel=parallel.sequence_parallel,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Fused kernels are CUDA (apex/TE) only; the plain torch paths are exact.
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        masked_softmax_fusion=use_te,
        apply_rope_fusion=False,
        persist_layer_norm=use_te,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=device_type == "cpu",
        recompute_granularity="full" if model.recompute_activations else None,
        recompute_method="uniform" if model.recompute_activations else None,
        recompute_num_layers=1 if model.recompute_activations else None,
        fp8="hybrid" if model.fp8 else None,
        # The actor divides every micro-batch's loss by the global response-token count
        # itself; this turns off megatron's division by the number of micro-batches and
        # makes DDP sum (not average) gradients over data-parallel ranks.
        calculate_per_token_loss=True,
        # Micro-batches are packed by a token budget, so their shapes differ; pipeline
        # stages exchange shapes before tensors.
        variable_seq_lengths=True,
        expert_model_parallel_size=parallel.ep_size,
        expert_tensor_parallel_size=1,
        # The all-to-all dispatcher (megatron refuses variable_seq_lengths with its default
        # allgather one, even for dense models); on gloo its uneven splits work too.
        moe_token_dispatcher_type="alltoall",
        **_moe_settings(model, use_te),
    )


def _moe_settings(model: ModelConfig, use_te: bool) -> dict:
    """megatron's mixture-of-experts settings for a family with experts (none for dense).

    The router is a softmax over every expert followed by top-k, as in HF. Megatron's
    ``moe_router_pre_softmax=False`` takes the top-k logits and softmaxes only those, which
    is HF's renormalised top-k (``norm_topk_prob=True``): softmax is monotone, and dividing
    the top-k of a softmax by their sum is the softmax of the top-k logits. With
    ``norm_topk_prob=False`` the weights are the full softmax's (``pre_softmax=True``).
    No capacity limit: every token reaches its experts (no dropping, exact log-probs).
    """
    if not family_named(model.family).moe:
        return {}
    aux = model.moe_aux_loss_coeff or 0.0
    pattern = moe_layers(model)
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not model.moe_norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_z_loss_coeff": model.moe_z_loss_coeff or None,
        "moe_expert_capacity_factor": None,
        # The router in fp32, as HF computes its softmax in float whatever the weights.
        "moe_router_dtype": "fp32",
        "moe_enable_routing_replay": model.routing_replay in ("rollout", "old"),
        "moe_grouped_gemm": use_te,
        "moe_permute_fusion": False,
        # Experts in every layer (1), or a 0/1 per layer (HF mlp_only_layers and
        # decoder_sparse_step): megatron then builds each layer's own spec.
        "moe_layer_freq": 1 if all(pattern) else [int(sparse) for sparse in pattern],
    }


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the tensor-parallel group.

    Megatron's ``copy_to_tensor_model_parallel_region`` does the same but all-reduces
    ``grad.contiguous()`` and returns the original ``grad``: when the incoming gradient is
    a non-contiguous view (here it is, GPTModel transposes the output to [b, s, h]) the
    reduced copy is dropped and every rank keeps only its own partial sum.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _defer_output_layer(output_layer) -> None:
    """Make the output layer hand back its (tensor-parallel-ready) input instead of logits.

    The actor computes log-probs and entropy fused with the output projection, chunk by
    chunk, so full-vocabulary logits never exist (see ``actor/vocab_parallel.py``). The
    layer keeps its weight (checkpoints, tied embeddings and gradient sync are unchanged);
    only its forward is swapped for one that applies the same tensor-parallel input
    mapping megatron's ColumnParallelLinear applies (sequence-parallel all-gather, or a
    copy whose backward all-reduces the gradient). The weight to project with is the model's
    ``output_weight`` (see :func:`output_weight`).
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    def forward(input_, weight=None, runtime_gather_output=None):
        group = output_layer.tp_group
        if output_layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        elif group is not None and group.size() > 1:
            hidden = _CopyToTensorParallelRegion.apply(input_, group)
        else:
            hidden = input_
        return hidden, None

    output_layer.forward = forward


def output_weight(gpt) -> torch.Tensor:
    """The ``[vocab_shard, hidden]`` weight the last stage projects hidden states with: the
    output layer's, or the shared embedding's when embeddings are tied (as GPTModel does)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class LocalRMSNorm:
    """The local spec's norm (torch's ``RMSNorm``, as megatron's ``WrappedTorchNorm``
    builds it) that also works under sequence parallelism: megatron's wrapper refuses
    it, although all it takes is what Transformer Engine's norms do, marking the weight
    ``sequence_parallel`` so that ``finalize_model_grads`` sums its gradient (each rank saw
    only its part of the sequence) over the tensor-parallel group. An MoE layer with
    tensor parallelism needs sequence parallelism (megatron's all-to-all dispatcher
    assumes each tensor-parallel rank holds different tokens)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _segment_groups(params, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The token indices ``[L, n]`` of a packed row's segments, grouped by length ``L``, and
    the permutation that puts the groups' tokens back in row order. Computed once per
    micro-batch (kept on its ``PackedSeqParams``), not once per layer: every layer of the
    row asks for the same."""
    cached = getattr(params, "segment_groups", None)
    if cached is None:
        bounds = params.cu_seqlens_q.tolist()
        by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        groups = [torch.tensor(starts)[None, :] + torch.arange(length)[:, None] for length, starts in by_length.items()]
        order = torch.cat([index.reshape(-1) for index in groups])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        cached = params.segment_groups = ([index.to(device) for index in groups], inverse.to(device))
    return cached


@functools.cache
def segment_attention_class():
    """megatron's local ``DotProductAttention``, made to take packed rows (THD, as
    Transformer Engine's attention does): given ``packed_seq_params``, the queries, keys
    and values ``[t, heads, dim]`` of a row are cut at ``cu_seqlens`` and each segment
    attends causally to itself alone, through megatron's own code (the segments of one
    length together, as one batch: a row of many short sequences makes few calls).

    megatron's local attention accepts no packed rows; a block-diagonal mask over the
    whole row would compute a ``heads x W x W`` score square for a row of ``W`` tokens
    (4 GiB per head at a 32k budget), most of it masked. Per segment, the work and the
    memory grow with the sum of the segments' squares, as padded rows' do. A class built
    on first use: megatron is imported lazily."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SegmentDotProductAttention(DotProductAttention):
        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            if self.attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"packed rows need causal attention, not {self.attn_mask_type}")
            groups, inverse = _segment_groups(packed_seq_params, query.device)
            # The segments of one length side by side as a batch: [L, n, heads, dim] in,
            # [L, n, heads * dim] out. With no mask, megatron's softmax applies its causal one.
            parts = [
                super(SegmentDotProductAttention, self)
                .forward(query[index], key[index], value[index], None)
                .reshape(index.numel(), 1, -1)
                for index in groups
            ]
            # Back to the row's token order: [t, 1, heads * dim].
            return torch.cat(parts, dim=0)[inverse]

    return SegmentDotProductAttention


def _with_local_modules(spec):
    """``spec`` (a ModuleSpec tree) with every ``WrappedTorchNorm`` replaced by
    :class:`LocalRMSNorm` and megatron's ``DotProductAttention`` by the one that also
    takes packed rows (:func:`segment_attention_class`)."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return LocalRMSNorm
    if spec is DotProductAttention:
        return segment_attention_class()
    if isinstance(spec, ModuleSpec):
        spec = dataclasses.replace(spec, module=_with_local_modules(spec.module))
        if spec.submodules is not None:
            spec.submodules = _with_local_modules(spec.submodules)
        return spec
    if isinstance(spec, list):
        return [_with_local_modules(item) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec, **{f.name: _with_local_modules(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        )
    return spec


MOE_NORM_KEY = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The checkpoint name of an MoE layer's pre-MLP norm under every spec: megatron's local
spec maps it so; its Transformer Engine spec (whose MoE layers keep a separate TENorm)
does not, so a checkpoint written under one would not load under the other."""


def with_moe_norm_keys(spec):
    """``spec`` (a layer spec, or a block spec's layer specs) with :data:`MOE_NORM_KEY` in
    the sharded-state-dict key map of every layer whose MLP is an MoE layer."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_moe_norm_keys(layer) for layer in spec.layer_specs])
    submodules = spec.submodules
    if getattr(getattr(submodules, "mlp", None), "module", None) is not MoELayer:
        return spec
    keys = {**(submodules.sharded_state_dict_keys_map or {}), **MOE_NORM_KEY}
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, sharded_state_dict_keys_map=keys))


def _without_te_router_gemm() -> None:
    """megatron-core 0.16.1's router linear tests ``te_general_gemm is not None``, a name
    ``moe_utils`` defines only when Transformer Engine imports: without TE (the CPU, or a
    GPU without the extra) every MoE forward raises NameError. Define it as None, which
    is what that test expects for "no TE" (the plain ``torch.mm`` path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


LOCAL_EXPERT = re.compile(  # megatron's names of a layer's local experts' weights (both MoE specs)
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)


def local_expert_of(name: str) -> Optional[tuple[str, int]]:
    """``(megatron expert key, local index)`` of a layer's local-expert parameter name
    (``mlp.experts.local_experts.{j}.linear_fc1.weight`` or ``mlp.experts.linear_fc1.weight{j}``),
    None for any other name."""
    match = LOCAL_EXPERT.match(name)
    if match is None:
        return None
    index, linear = (match.group(1), match.group(2)) if match.group(1) is not None else (match.group(4), match.group(3))
    return f"mlp.experts.experts.{linear}.weight", int(index)


def _mark_experts(gpt) -> None:
    """Mark every expert weight as megatron marks it at ep > 1 (``allreduce=False``), at
    ep 1 too. Then DDP reduces expert gradients over the expert-data-parallel group,
    which (expert-tensor-parallel size 1) spans the attention's tensor-parallel ranks,
    each of which routed its own part of the sequence: reduced with the dense weights
    over the data-parallel group only, their tensor-parallel partial sums would be lost.
    And the experts get their own optimizer at every ep size, so the optimizer state of
    a checkpoint has the same structure, and moves between ep sizes."""
    for name, param in gpt.named_parameters():
        if name.startswith("decoder.layers.") and local_expert_of(name.split(".", 3)[3]) is not None:
            param.allreduce = False


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    device_type: str,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    output_logits: bool = True,
):
    """The GPTModel piece of this rank's pipeline stage.

    ``pre_process`` / ``post_process`` default to whether this rank is the first / last
    pipeline stage (embedding / output layer live there). With ``output_logits=False`` the
    last stage returns final hidden states ``[batch, seq, hidden]`` instead of logits, to
    be projected with :func:`output_weight`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import transformer_block

    config = transformer_config(model, parallel, device_type)
    experts = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": config.moe_grouped_gemm}
    if config.num_moe_experts:
        _without_te_router_gemm()
    if isinstance(config.moe_layer_freq, list):
        # Dense layers among the MoE ones: a spec per layer of this stage.
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine(model, device_type), normalization="RMSNorm"
        )
        if not use_transformer_engine(model, device_type):
            layer_spec = _with_local_modules(layer_spec)
    elif use_transformer_engine(model, device_type):
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **experts)
    else:
        # Sequential experts (one MLP each, no grouped GEMM) on the CPU.
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm", **experts)
        layer_spec = _with_local_modules(layer_spec)
    if config.num_moe_experts:
        layer_spec = with_moe_norm_keys(layer_spec)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    # The block's final norm is its module-level LayerNormImpl (the local one: torch's).
    final_norm = transformer_block.LayerNormImpl
    if not use_transformer_engine(model, device_type):
        transformer_block.LayerNormImpl = _with_local_modules(final_norm)
    try:
        gpt = _gpt_model(GPTModel, config, layer_spec, model, parallel, pre_process, post_process)
    finally:
        transformer_block.LayerNormImpl = final_norm
    if config.num_moe_experts:
        _mark_experts(gpt)
    if post_process and not output_logits:
        _defer_output_layer(gpt.output_layer)
    if device_type == "cuda":
        gpt = gpt.cuda(torch.cuda.current_device())
    return gpt


def _gpt_model(GPTModel, config, layer_spec, model: ModelConfig, parallel: ParallelConfig, pre_process, post_process):
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, parallel.tp_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(model.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=model.rope_theta,
        parallel_output=True,
    )
