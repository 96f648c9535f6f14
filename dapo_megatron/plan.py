"""``dapo-megatron plan``: will this layout fit, before the job waits in a queue?

Arithmetic only (no GPU, no model): from a resolved config it counts the model's
parameters exactly, places them on pipeline stages and tensor-parallel ranks (vocabulary
padded as megatron pads it), and estimates the memory of one GPU on the heaviest stage
in the two phases of a colocated DAPO step:

- **train**: bf16 weights + fp32 gradient buffer + distributed-optimizer state (fp32 main
  weights, Adam m and v, sharded over data-parallel ranks) + activations of the
  micro-batch token budget (1F1B keeps ``pp_size`` micro-batches in flight on the first
  stage; per token and layer ``h * (10 + 24 / tp)`` bytes, ``h * 34 / tp`` with sequence
  parallelism, ``2h`` (``2h / tp``) with full recomputation; flash attention assumed, so
  no ``s^2`` term) + the chunked log-prob buffers + a fixed framework overhead;
- **rollout**: the actor's weights, gradients and optimizer state stay resident, and
  SGLang takes ``gpu_memory_utilization`` of the GPU for its weights and KV cache.

The activation formula is the one of Korthikanti et al. (2022) for bf16 transformer
layers; these are estimates to size a job, not measurements. A layout that does not fit is
refused with the phase that overflows and the smallest single change that would fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from dapo_megatron.config import (
    Config,
    ConfigError,
    apply_override,
    data_parallel_size,
    padded_vocab_size,
    pipeline_layer_split,
    validate,
)

GIB = 2**30
OVERHEAD_BYTES = 3 * GIB
"""CUDA context, NCCL buffers and allocator fragmentation, per GPU."""
LOGPROB_CHUNK_BYTES = 128 * 2**20
"""One chunk of fp32 logits in the fused log-prob (see actor/vocab_parallel.py)."""


def layer_parameters(config: Config) -> tuple[int, int]:
    """``(tensor-parallel-sharded, replicated)`` parameters of one transformer layer."""
    m = config.model
    head_dim = m.hidden_size // m.num_attention_heads
    kv = m.num_query_groups * head_dim
    qkv = m.hidden_size * (m.num_attention_heads * head_dim + 2 * kv) + (m.num_attention_heads * head_dim + 2 * kv)
    proj = m.hidden_size * m.num_attention_heads * head_dim
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    return qkv + proj + mlp, 2 * m.hidden_size


def count_parameters(config: Config) -> int:
    """Exact parameter count of the (unpadded) HF model."""
    m = config.model
    sharded, replicated = layer_parameters(config)
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * (sharded + replicated) + m.hidden_size + embeddings


def stage_parameters_per_gpu(config: Config) -> list[int]:
    """Parameters held by one GPU of each pipeline stage (padded vocabulary)."""
    m, p = config.model, config.parallel
    sharded, replicated = layer_parameters(config)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size) * m.hidden_size
    per_stage = []
    split = pipeline_layer_split(m.num_layers, p)
    for stage, layers in enumerate(split):
        stage_sharded, stage_replicated = layers * sharded, layers * replicated
        if stage == 0:
            stage_sharded += vocab
        if stage == len(split) - 1:
            stage_replicated += m.hidden_size
            # The output layer; with tied embeddings and pp > 1 megatron keeps a copy here.
            if not m.tie_word_embeddings or len(split) > 1:
                stage_sharded += vocab
        per_stage.append(stage_sharded // p.tp_size + stage_replicated)
    return per_stage


@dataclass
class MemoryEstimate:
    """Bytes on one GPU of the heaviest pipeline stage."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    activations_no_recompute: int
    activations_recompute: int
    logprob: int
    sglang: int
    sglang_weights: int
    sglang_kv_cache: int
    kv_cache_tokens: int
    overhead: int = OVERHEAD_BYTES

    @property
    def train_phase(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logprob + self.overhead

    @property
    def rollout_phase(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.sglang + self.overhead


def estimate_memory(config: Config) -> MemoryEstimate:
    """Per-GPU memory of the heaviest stage; see the module docstring for each term."""
    m, p, r, t = config.model, config.parallel, config.rollout, config.trainer
    dp = data_parallel_size(p)
    params = max(stage_parameters_per_gpu(config))
    param_bytes = 4 if m.params_dtype == "float32" else 2
    layers = max(pipeline_layer_split(m.num_layers, p))
    tokens = t.micro_batch_max_tokens
    h = m.hidden_size
    recompute_per_token_layer = 2 * h / (p.tp_size if p.sequence_parallel else 1)
    full_per_token_layer = h * 34 / p.tp_size if p.sequence_parallel else h * (10 + 24 / p.tp_size)
    activations_recompute = int(layers * tokens * recompute_per_token_layer * p.pp_size)
    activations_no_recompute = int(layers * tokens * full_per_token_layer * p.pp_size)
    vocab_shard = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size) // p.tp_size
    chunk_tokens = min(tokens, max(16, LOGPROB_CHUNK_BYTES // (4 * vocab_shard)))
    logprob = 2 * chunk_tokens * vocab_shard * 4 + tokens * h * param_bytes
    gpu = int(p.gpu_memory_gb * GIB)
    sglang = int(r.gpu_memory_utilization * gpu)
    sglang_weights = count_parameters(config) * 2 // r.engine_tp_size
    head_dim = h // m.num_attention_heads
    kv_per_token = 2 * m.num_layers * m.num_query_groups * head_dim * 2 / r.engine_tp_size
    kv_cache = max(0, sglang - sglang_weights)
    return MemoryEstimate(
        parameters=params,
        weights=params * param_bytes,
        gradients=params * 4,
        optimizer=params * 12 // (dp if p.use_distributed_optimizer else 1),
        activations=activations_recompute if m.recompute_activations else activations_no_recompute,
        activations_no_recompute=activations_no_recompute,
        activations_recompute=activations_recompute,
        logprob=logprob,
        sglang=sglang,
        sglang_weights=sglang_weights,
        sglang_kv_cache=kv_cache,
        kv_cache_tokens=int(kv_cache // kv_per_token),
    )


@dataclass
class Plan:
    """What ``plan`` found for one config."""

    config: Config
    num_parameters: int
    padded_vocab: int
    layer_split: list[int]
    memory: MemoryEstimate
    problems: list[str] = field(default_factory=list)
    suggestion: Optional[str] = None

    @property
    def fits(self) -> bool:
        return not self.problems


def _problems(config: Config, memory: MemoryEstimate) -> list[str]:
    gpu = int(config.parallel.gpu_memory_gb * GIB)
    problems = []
    if memory.train_phase > gpu:
        problems.append(
            f"train phase needs {memory.train_phase / GIB:.1f} GiB per GPU > parallel.gpu_memory_gb="
            f"{config.parallel.gpu_memory_gb:g} (activations {memory.activations / GIB:.1f} GiB)"
        )
    if memory.rollout_phase > gpu:
        problems.append(
            f"rollout phase needs {memory.rollout_phase / GIB:.1f} GiB per GPU > parallel.gpu_memory_gb="
            f"{config.parallel.gpu_memory_gb:g} (SGLang rollout.gpu_memory_utilization="
            f"{config.rollout.gpu_memory_utilization:g} on top of the resident actor)"
        )
    r, world = config.rollout, config.parallel.world_size
    if r.colocate and r.num_engines * r.engine_tp_size != world:
        problems.append(
            f"colocated engines must cover the actor's GPUs: rollout.num_engines x rollout.engine_tp_size = "
            f"{r.num_engines} x {r.engine_tp_size} = {r.num_engines * r.engine_tp_size}, world size {world}"
        )
    if config.rollout.engine != "hf" and memory.sglang_kv_cache <= 0:
        problems.append(
            f"SGLang weights ({memory.sglang_weights / GIB:.1f} GiB per GPU at rollout.engine_tp_size="
            f"{config.rollout.engine_tp_size}) leave no KV cache within rollout.gpu_memory_utilization"
        )
    return problems


def _candidate_changes(config: Config) -> list[tuple[str, str]]:
    """Single changes to try, cheapest first: ``(overrides, why)``; a change may need two
    keys that belong together (engine width and engine count)."""
    m, p, r, t = config.model, config.parallel, config.rollout, config.trainer
    changes = []
    world = p.world_size
    if r.colocate and r.num_engines * r.engine_tp_size != world and world % r.engine_tp_size == 0:
        changes.append((f"rollout.num_engines={world // r.engine_tp_size}", "one engine per engine_tp_size GPUs"))
    if not m.recompute_activations:
        changes.append(("model.recompute_activations=true", "recompute activations in backward"))
    if not p.sequence_parallel and p.tp_size > 1 and p.device != "cpu" and m.transformer_impl != "local":
        changes.append(("parallel.sequence_parallel=true", "shard activations over tensor-parallel ranks"))
    longest = r.max_prompt_length + r.max_response_length
    if t.micro_batch_max_tokens // 2 >= longest:
        changes.append((f"trainer.micro_batch_max_tokens={t.micro_batch_max_tokens // 2}", "halve the token budget"))
    for fraction in (0.8, 0.7, 0.6, 0.5, 0.4):
        if fraction < r.gpu_memory_utilization:
            changes.append((f"rollout.gpu_memory_utilization={fraction}", "give SGLang less memory"))
    changes.append((f"parallel.pp_size={p.pp_size * 2}", "more pipeline stages"))
    if p.tp_size < 8:
        changes.append((f"parallel.tp_size={p.tp_size * 2}", "wider tensor parallelism"))
    if r.engine_tp_size < 8:
        wider = r.engine_tp_size * 2
        engines = f" rollout.num_engines={world // wider}" if r.colocate and world % wider == 0 else ""
        changes.append((f"rollout.engine_tp_size={wider}{engines}", "wider SGLang engines"))
    return changes


def _with_overrides(config: Config, overrides: str) -> Config:
    copy = dataclasses.replace(
        config, **{f.name: dataclasses.replace(getattr(config, f.name)) for f in dataclasses.fields(config)}
    )
    for override in overrides.split():
        apply_override(copy, override)
    validate(copy)
    return copy


def make_plan(config: Config, *, suggest: bool = True) -> Plan:
    """Count, place and estimate; on overflow, search for the smallest change that fits."""
    m, p = config.model, config.parallel
    memory = estimate_memory(config)
    plan = Plan(
        config=config,
        num_parameters=count_parameters(config),
        padded_vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size),
        layer_split=pipeline_layer_split(m.num_layers, p),
        memory=memory,
        problems=_problems(config, memory),
    )
    if plan.problems and suggest:
        for override, why in _candidate_changes(config):
            try:
                changed = _with_overrides(config, override)
            except ConfigError:
                continue
            if make_plan(changed, suggest=False).fits:
                plan.suggestion = f"{override} ({why})"
                break
        else:
            plan.suggestion = "no single change fits; use more nodes (parallel.num_nodes)"
    return plan


def format_plan(plan: Plan) -> str:
    """The table ``dapo-megatron plan`` prints."""
    c, mem = plan.config, plan.memory
    p, r = c.parallel, c.rollout
    gib = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
    lines = [
        f"model: {plan.num_parameters:,} parameters ({c.model.num_layers} layers, hidden {c.model.hidden_size}, "
        f"vocab {c.model.vocab_size} padded to {plan.padded_vocab})",
        f"layout: world {p.world_size} = tp {p.tp_size} x pp {p.pp_size} x dp {data_parallel_size(p)} x cp {p.cp_size}; "
        f"layers per stage {plan.layer_split}; sequence_parallel={p.sequence_parallel}; "
        f"recompute={c.model.recompute_activations}",
        f"rollout: {r.num_engines} SGLang engines x tp {r.engine_tp_size}, gpu_memory_utilization {r.gpu_memory_utilization:g}",
        f"per GPU, heaviest stage ({mem.parameters:,} parameters):",
        f"  weights (bf16)                 {gib(mem.weights)}",
        f"  gradients (fp32 buffer)        {gib(mem.gradients)}",
        f"  optimizer (fp32 main+m+v / dp) {gib(mem.optimizer)}",
        f"  activations ({c.trainer.micro_batch_max_tokens} tokens x {p.pp_size} in flight, "
        f"{'with' if c.model.recompute_activations else 'without'} recompute) {gib(mem.activations)}",
        f"    (without recompute {mem.activations_no_recompute / GIB:.2f} GiB, with {mem.activations_recompute / GIB:.2f} GiB)",
        f"  log-prob buffers               {gib(mem.logprob)}",
        f"  framework overhead             {gib(mem.overhead)}",
        f"  = train phase                  {gib(mem.train_phase)}",
        f"  SGLang (weights {mem.sglang_weights / GIB:.2f} GiB + KV cache {mem.sglang_kv_cache / GIB:.2f} GiB "
        f"= {mem.kv_cache_tokens:,} tokens) {gib(mem.sglang)}",
        f"  = rollout phase                {gib(mem.rollout_phase)}",
        f"GPU memory: {p.gpu_memory_gb:g} GiB",
    ]
    if plan.fits:
        lines.append("fits")
    else:
        lines += [f"does not fit: {problem}" for problem in plan.problems]
        lines.append(f"smallest change that fits: {plan.suggestion}")
    return "\n".join(lines)
