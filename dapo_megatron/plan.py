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
  no ``s^2`` term, except under megatron's local attention, which builds each sequence's
  score square: :func:`local_attention_bytes`) + the chunked log-prob buffers + a fixed
  framework overhead;
- **rollout**: the actor's weights, gradients and optimizer state stay resident, and
  SGLang takes ``gpu_memory_utilization`` of the GPU for its weights and KV cache (the
  transformers engine, ``rollout.engine=hf``, instead holds fp32 weights and a KV cache
  for its share of the generation batch).

Both phases also hold, on a stage's leader, the weight sync's q/k/v export buffers: the
HF-layout q, k and v of every layer of the stage, gathered over tensor parallelism and
kept between syncs (2.3 GiB at 32B with pp 2), and on a feeder its two staging buffers,
each as large as the largest bucket (a tensor over ``rollout.weight_sync_bucket_mb``,
the embedding or the output layer, is a bucket of its own: 1.56 GB at 32B). The rollout
phase (a sync runs while the engines hold their memory) adds what a sync holds only while
it runs (:func:`sync_in_flight_bytes`). The CPU runtime's sync sends shards as they are
and keeps none.

Actor ranks wait in a collective only while they train, compute log-probs, save or sync
weights: never while the engines generate (the driver calls the ranks between
generations; with async generation they train meanwhile, all of them together). So the
collective timeout (``parallel.timeout_minutes``) must cover the longest of those, not a
rollout phase, however long the responses; the plan states it.

It also says what the job listens on, for whoever must open (or keep closed) a firewall:
every port is picked free when the run starts, on 127.0.0.1 with a local Ray instance
and on each node's address as Ray knows it on a cluster, never on every interface.

On the CPU (``parallel.device=cpu``) there is no GPU: every actor rank and every engine is
a process of one machine, all resident at once, so the plan adds them up against this
machine's memory: fp32 weights, gradients and Adam state per rank, fp32 activations
(twice the bf16 formula's bytes), each transformers engine's fp32 weights and KV cache,
and a process overhead each. ``parallel.device=auto`` is planned as a GPU run.

The activation formula is the one of Korthikanti et al. (2022) for bf16 transformer
layers; these are estimates to size a job, not measurements. A layout that does not fit is
refused with the phase that overflows and the smallest single change that would fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from dapo_megatron.config import (
    Config,
    ConfigError,
    moe_layers,
    padded_vocab_size,
)
from dapo_megatron.config.io import apply_override
from dapo_megatron.config.validate import validate
from dapo_megatron.families import family_named

GIB = 2**30
OVERHEAD_BYTES = 3 * GIB
"""CUDA context, NCCL buffers and allocator fragmentation, per GPU."""
CPU_PROCESS_BYTES = 1 * GIB
"""One CPU rank or engine process: importing torch, megatron-core, transformers and Ray
alone takes 0.42 GiB of resident memory (measured on this project's CPU machine)."""
CUDA_CONTEXT_BYTES = GIB // 2
"""One process's CUDA context on a GPU (an SGLang TP worker opening a CUDA IPC share of
the feeder's GPU creates one there)."""
LOGPROB_CHUNK_BYTES = 128 * 2**20
"""One chunk of fp32 logits in the fused log-prob (see actor/vocab_parallel.py)."""


def qkv_parameters(config: Config) -> int:
    """Parameters of one layer's q, k and v projections, weights and biases if the family
    has them (whole)."""
    m = config.model
    rows = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    return rows * (m.hidden_size + int(family_named(m.family).qkv_bias))


def layer_parameters(config: Config, layer: int = 0) -> tuple[int, int]:
    """``(tensor-parallel-sharded, replicated)`` parameters of transformer layer ``layer``,
    experts left out (:func:`expert_parameters`): the replicated ones are its two RMSNorms
    (the q/k norms of families that have them, and the router of a layer with experts)."""
    m = config.model
    qkv = qkv_parameters(config)
    proj = m.hidden_size * m.num_attention_heads * m.head_dim
    moe = moe_layers(m)[layer]
    mlp = 0 if moe else 3 * m.hidden_size * m.ffn_hidden_size
    router = m.num_experts * m.hidden_size if moe else 0
    qk_norms = 2 * m.head_dim if family_named(m.family).qk_norm else 0
    return qkv + proj + mlp, 2 * m.hidden_size + qk_norms + router


def expert_parameters(config: Config, layer: int = 0) -> int:
    """Parameters of layer ``layer``'s experts, all of them (0 for a dense layer); split
    over the expert-parallel ranks, each expert whole on its rank."""
    m = config.model
    if not moe_layers(m)[layer]:
        return 0
    return m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size


def active_parameters(config: Config) -> int:
    """Parameters one token goes through: all but the experts it is not routed to (the
    top-k experts of each layer, the router, attention, embeddings)."""
    m = config.model
    total = count_parameters(config)
    if not family_named(m.family).moe:
        return total
    experts = sum(expert_parameters(config, i) for i in range(m.num_layers))
    return total - experts * (m.num_experts - m.moe_router_topk) // m.num_experts


def count_parameters(config: Config) -> int:
    """Exact parameter count of the (unpadded) HF model."""
    m = config.model
    layers = sum(sum(layer_parameters(config, i)) + expert_parameters(config, i) for i in range(m.num_layers))
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return layers + m.hidden_size + embeddings


def stage_parameters_per_gpu(config: Config) -> list[int]:
    """Parameters held by one GPU of each pipeline stage (padded vocabulary)."""
    return [dense + experts for dense, experts in stage_parameters_by_kind(config)]


def stage_parameters_by_kind(config: Config) -> list[tuple[int, int]]:
    """``(dense, expert)`` parameters on one GPU of each pipeline stage: their optimizer
    states are sharded over different groups (data-parallel, expert-data-parallel)."""
    m, p = config.model, config.parallel
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size) * m.hidden_size
    per_stage = []
    split = p.stage_layers(m.num_layers)
    for stage, indices in enumerate(_stage_layers(split)):
        stage_sharded = sum(layer_parameters(config, i)[0] for i in indices)
        stage_replicated = sum(layer_parameters(config, i)[1] for i in indices)
        stage_experts = sum(expert_parameters(config, i) for i in indices)
        if stage == 0:
            stage_sharded += vocab
        if stage == len(split) - 1:
            stage_replicated += m.hidden_size
            # The output layer; with tied embeddings and pp > 1 megatron keeps a copy here.
            if not m.tie_word_embeddings or len(split) > 1:
                stage_sharded += vocab
        per_stage.append((stage_sharded // p.tp_size + stage_replicated, stage_experts // p.ep_size))
    return per_stage


def _stage_layers(split: list[int]) -> list[range]:
    """The global layer indices of each pipeline stage."""
    starts = [sum(split[:stage]) for stage in range(len(split))]
    return [range(start, start + layers) for start, layers in zip(starts, split)]


def moe_activation_bytes(config: Config, tokens: int, layers: int, dtype_bytes: float) -> int:
    """What the MoE layers of a stage keep for backward beyond the dense formula's MLP:
    each token's ``k`` copies after dispatch (the all-to-all's send and receive buffers
    of ``k h``), the experts' gate/up output (``2 f_e``) and activation (``f_e``) for each
    copy, and the router's fp32 scores (``E``); tokens under sequence parallelism are a
    rank's share. 0 for a dense family."""
    m, p = config.model, config.parallel
    if not family_named(m.family).moe:
        return 0
    local = tokens / (p.tp_size if p.sequence_parallel else 1)
    per_token = m.moe_router_topk * (2 * m.hidden_size + 3 * m.moe_ffn_hidden_size) * dtype_bytes + 4 * m.num_experts
    return int(layers * local * per_token * p.pp_size)


def local_attention_bytes(config: Config, layers: int, dtype_bytes: float) -> tuple[int, int]:
    """What megatron's local attention (the CPU, or ``model.transformer_impl=local``) adds
    to the flash-attention formula, without and with full recompute: each segment of a
    micro-batch (a packed row's sequence, or a padded row) gets its ``[heads / tp, L, L]``
    scores, whose softmax is kept for backward. With segments of at most ``S`` tokens
    (``rollout.max_prompt_length + rollout.max_response_length``, at most the budget ``T``)
    their squares add up to at most ``T * S`` per layer: kept for every layer of the
    micro-batches in flight without recompute, for one layer at a time with it; plus the
    scores buffer megatron keeps (the largest square). 0 where Transformer Engine's
    flash attention runs (a GPU with ``transformer_impl`` auto or transformer_engine)."""
    m, p = config.model, config.parallel
    if p.device != "cpu" and m.transformer_impl != "local":
        return 0, 0
    tokens = config.trainer.micro_batch_max_tokens
    longest = min(config.rollout.max_prompt_length + config.rollout.max_response_length, tokens)
    heads = m.num_attention_heads / p.tp_size
    per_layer = heads * tokens * longest * dtype_bytes
    buffer = heads * longest * longest * dtype_bytes
    return int(per_layer * layers * p.pp_size + buffer), int(per_layer + buffer)


def parameter_bytes(config: Config) -> int:
    """Bytes per parameter: fp32 when asked for, or on the CPU with ``auto``; else bf16."""
    m = config.model
    return 4 if m.params_dtype == "float32" or (config.parallel.device == "cpu" and m.params_dtype == "auto") else 2


def stage_sync_bytes(config: Config) -> list[int]:
    """Bytes of each pipeline stage's weights as a weight sync sends them: HF tensors
    (vocabulary unpadded, the output layer only when untied) in the parameters' dtype."""
    m, p = config.model, config.parallel
    param_bytes = parameter_bytes(config)
    vocab = m.vocab_size * m.hidden_size
    split = p.stage_layers(m.num_layers)
    stages = []
    for stage, indices in enumerate(_stage_layers(split)):
        params = sum(sum(layer_parameters(config, i)) + expert_parameters(config, i) for i in indices)
        if stage == 0:
            params += vocab
        if stage == len(split) - 1:
            params += m.hidden_size + (0 if m.tie_word_embeddings else vocab)
        stages.append(params * param_bytes)
    return stages


def sync_traffic_plan(config: Config) -> Optional[str]:
    """What each node sends and receives over the network per weight sync, for colocated
    GPU engines fed as ``train`` feeds them (ranks r on node r // devices_per_node, GPU
    r % devices_per_node, as Ray places them; ``plan --rehearse`` shows the real map);
    None on one node or the CPU runtime."""
    from dapo_megatron.orchestration.placement import choose_feeders, colocated_engine_slots, rank_coordinates
    from dapo_megatron.weight_sync.roles import sync_roles, sync_traffic

    p, r = config.parallel, config.rollout
    if p.num_nodes == 1 or p.device == "cpu":
        return None
    stage_bytes = stage_sync_bytes(config)
    per_node = p.num_devices_per_node
    ranks = [
        (rank, c["dp_rank"], c["tp_rank"], c["pp_rank"])
        for rank in range(p.world_size)
        for c in [rank_coordinates(p, rank)]
    ]
    nodes = [rank // per_node for rank in range(p.world_size)]
    gb = 1e9
    if not r.colocate:
        leader_stages = len(stage_bytes) - 1
        return (
            f"weight sync: rank 0 gathers the {leader_stages} other stage(s) ({sum(stage_bytes[1:]) / gb:.1f} GB) "
            f"and broadcasts {sum(stage_bytes) / gb:.1f} GB to {r.num_engines} separate engine(s) per sync"
        )
    try:
        slots = colocated_engine_slots(r.num_engines, r.engine_tp_size, p.num_nodes, per_node)
    except ValueError:
        return None
    rank_places = [(str(nodes[rank]), [rank % per_node]) for rank in range(p.world_size)]
    engine_places = [(str(node), list(range(base, base + r.engine_tp_size))) for node, base in slots]
    feeders = choose_feeders(engine_places, rank_places, sync_roles(ranks).valid_feeders)
    traffic = sync_traffic(feeders, ranks, nodes, stage_bytes)
    if not traffic:
        return f"weight sync: {sum(stage_bytes) / gb:.1f} GB per engine, all within each node"
    most_sent = max(sent for sent, _ in traffic.values())
    most_received = max(received for _, received in traffic.values())
    return (
        f"weight sync: {sum(stage_bytes) / gb:.1f} GB of weights per engine, {len(feeders)} feeder rank(s) on "
        f"{len({nodes[f] for f in feeders})} node(s), each fed by its own replica's stage leaders; per node and sync at most "
        f"{most_sent / gb:.1f} GB sent and {most_received / gb:.1f} GB received over the network"
    )


def planned_engine(config: Config) -> str:
    """``sglang`` or ``hf``: ``rollout.engine``; ``auto`` is SGLang unless the run is on the CPU."""
    if config.rollout.engine != "auto":
        return config.rollout.engine
    return "hf" if config.parallel.device == "cpu" else "sglang"


def kv_cache_bytes_per_token(config: Config, dtype_bytes: int, tp_size: int = 1) -> float:
    """Keys and values of every layer for one token, split over ``tp_size`` ranks."""
    m = config.model
    return 2 * m.num_layers * m.num_query_groups * m.head_dim * dtype_bytes / tp_size


def hf_engine_bytes(config: Config) -> tuple[int, int]:
    """``(weights, KV cache)`` of one transformers engine: fp32 weights, and keys and values
    for its share of a generation round at full length (the cache grows to that)."""
    r, d = config.rollout, config.data
    rows = (d.gen_batch_size or d.train_batch_size) * r.n_samples_per_prompt
    rows_per_engine = -(-rows // r.num_engines)
    length = r.max_prompt_length + r.max_response_length
    return count_parameters(config) * 4, int(rows_per_engine * length * kv_cache_bytes_per_token(config, 4))


@dataclass
class MemoryEstimate:
    """Bytes on one GPU of the heaviest pipeline stage (or one CPU rank)."""

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
    engine: str = "sglang"
    """The engine planned: ``sglang`` or ``hf``."""
    hf_engine_weights: int = 0
    """One transformers engine's fp32 weights (``engine == "hf"``)."""
    hf_engine_kv_cache: int = 0
    """One transformers engine's KV cache for its share of a generation round."""
    engines_per_gpu: int = 1
    """Transformers engines on the busiest GPU (``engine == "hf"`` on a GPU)."""
    sync_export: int = 0
    """The weight sync's q/k/v export buffers on the heaviest stage's leader (GPU runs)."""
    reference: int = 0
    """The KL penalty's frozen reference policy (``algorithm.use_kl_loss``): one more copy
    of the stage's weights, without gradients or optimizer state."""
    engines_colocated: bool = True
    """Whether the engines share the actor's GPUs (``rollout.colocate``); separate engines
    hold GPUs of their own and add nothing to the actor's."""
    sync_staging: int = 0
    """A feeder's two reusable weight-sync staging buffers, kept across syncs (colocated
    SGLang engines): each grows to the largest bucket it takes, the largest of all at
    worst (``rollout.weight_sync_bucket_mb``, or one tensor larger than that)."""
    sync_in_flight: int = 0
    """What a sync holds on a feeder (rank 0 for separate engines) only while it runs
    (:func:`sync_in_flight_bytes`): the gathered tensors of the buckets in flight."""
    sync_engine_copy: int = 0
    """What a colocated sync holds on each engine GPU but its feeder's while it runs:
    SGLang's TP worker there copies the whole bucket it maps onto its own GPU (the largest
    bucket at worst)."""
    engine_contexts: int = 0
    """The CUDA contexts the SGLang TP workers a feeder serves open on its GPU to map its
    shares (one per worker)."""
    update_group: int = 0
    """The weight-update communicator's buffers on rank 0 (separate engines)."""
    checkpoint_host: int = 0
    """Host memory a data-parallel rank 0 holds while saving a checkpoint: its shard's
    fp32 main weights and Adam moments, gathered from its data-parallel peers."""
    gpu: int = 0
    """The GPU's memory (``parallel.gpu_memory_gb``)."""

    @property
    def sync_resident(self) -> int:
        """What the weight sync keeps on the busiest feeder's GPU across steps."""
        return self.sync_export + self.sync_staging + self.engine_contexts + self.update_group

    @property
    def sync_transient(self) -> int:
        """What a running sync adds on the busiest GPU (the feeder's buckets in flight, or
        an engine worker's bucket copy on another GPU: the larger)."""
        return max(self.sync_in_flight, self.sync_engine_copy)

    @property
    def train_phase(self) -> int:
        return (
            self.weights
            + self.reference
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logprob
            + self.sync_resident
            + self.overhead
        )

    @property
    def hf_engine(self) -> int:
        return self.hf_engine_weights + self.hf_engine_kv_cache

    @property
    def rollout_phase(self) -> int:
        engines = self.sglang if self.engine == "sglang" else self.engines_per_gpu * self.hf_engine
        if not self.engines_colocated:
            engines = 0
        return (
            self.weights
            + self.reference
            + self.gradients
            + self.optimizer
            + engines
            + self.sync_resident
            + self.sync_transient
            + self.overhead
        )

    @property
    def actor_allowance(self) -> int:
        """What SGLang leaves the colocated actor: the GPU minus its static fraction."""
        return self.gpu - self.sglang

    @property
    def sglang_weights_fit(self) -> bool:
        return self.sglang_weights < self.sglang


@dataclass
class HostEstimate:
    """The CPU runtime: every rank and engine process of one machine, resident at once."""

    ranks: int
    """Actor ranks on this machine."""
    rank_bytes: int
    """One rank: the train-phase terms in fp32 plus a process overhead."""
    engines: int
    """Rollout engine processes on this machine."""
    engine_bytes: int
    """One transformers engine: fp32 weights, KV cache, process overhead."""
    available: int
    """This machine's physical memory."""
    routing_records: int = 0
    """The routing records of a step (``model.routing_replay``) on the driver and, their
    replica's share, on every actor rank (:func:`routing_record_bytes`)."""

    @property
    def total(self) -> int:
        return self.ranks * self.rank_bytes + self.engines * self.engine_bytes + self.routing_records


def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sync_export_bytes(config: Config, param_bytes: int) -> int:
    """The q/k/v export buffers a stage leader keeps for the weight sync: HF q, k and v
    weights and biases of each of the heaviest stage's layers, whole (gathered over TP)."""
    layers = max(config.parallel.stage_layers(config.model.num_layers))
    return layers * qkv_parameters(config) * param_bytes


def estimate_memory(config: Config) -> MemoryEstimate:
    """Per-GPU memory of the heaviest stage; see the module docstring for each term."""
    m, p, r, t = config.model, config.parallel, config.rollout, config.trainer
    dp = p.data_parallel_size
    by_kind = stage_parameters_by_kind(config)
    heaviest = max(range(len(by_kind)), key=lambda stage: sum(by_kind[stage]))
    dense_params, expert_params = by_kind[heaviest]
    params = dense_params + expert_params
    on_cpu = p.device == "cpu"
    param_bytes = parameter_bytes(config)
    # The activation formula counts 2-byte activations; fp32 runs hold twice that.
    activation_scale = param_bytes / 2
    layers = max(p.stage_layers(m.num_layers))
    tokens = t.micro_batch_max_tokens
    h = m.hidden_size
    recompute_per_token_layer = 2 * h / (p.tp_size if p.sequence_parallel else 1)
    full_per_token_layer = h * 34 / p.tp_size if p.sequence_parallel else h * (10 + 24 / p.tp_size)
    activations_recompute = int(layers * tokens * recompute_per_token_layer * p.pp_size * activation_scale)
    activations_no_recompute = int(layers * tokens * full_per_token_layer * p.pp_size * activation_scale)
    # The MoE layers' share of the heaviest stage (all of them but mlp_only_layers).
    moe_share = sum(moe_layers(m)) / m.num_layers
    activations_no_recompute += moe_activation_bytes(config, tokens, round(layers * moe_share), param_bytes)
    squares_no_recompute, squares_recompute = local_attention_bytes(config, layers, param_bytes)
    activations_no_recompute += squares_no_recompute
    activations_recompute += squares_recompute
    vocab_shard = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size) // p.tp_size
    chunk_tokens = min(tokens, max(16, LOGPROB_CHUNK_BYTES // (4 * vocab_shard)))
    logprob = 2 * chunk_tokens * vocab_shard * 4 + tokens * h * param_bytes
    gpu = int(p.gpu_memory_gb * GIB)
    sglang = int(r.gpu_memory_utilization * gpu)
    sglang_weights = count_parameters(config) * 2 // r.engine_tp_size
    kv_per_token = kv_cache_bytes_per_token(config, 2, r.engine_tp_size)
    kv_cache = max(0, sglang - sglang_weights)
    engine = planned_engine(config)
    hf_weights, hf_kv_cache = hf_engine_bytes(config) if engine == "hf" else (0, 0)
    # Adam m and v in fp32, plus fp32 main weights when the parameters are not fp32.
    optimizer_bytes = 8 if param_bytes == 4 else 12
    return MemoryEstimate(
        parameters=params,
        weights=params * param_bytes,
        gradients=params * 4,
        optimizer=(
            dense_params * optimizer_bytes // dp
            + expert_params * optimizer_bytes // config.parallel.expert_data_parallel_size
            if p.use_distributed_optimizer
            else params * optimizer_bytes
        ),
        activations=activations_recompute if m.recompute_activations else activations_no_recompute,
        activations_no_recompute=activations_no_recompute,
        activations_recompute=activations_recompute,
        logprob=logprob,
        sglang=sglang,
        sglang_weights=sglang_weights,
        sglang_kv_cache=kv_cache,
        kv_cache_tokens=int(kv_cache // kv_per_token),
        overhead=CPU_PROCESS_BYTES if on_cpu else OVERHEAD_BYTES,
        engine=engine,
        hf_engine_weights=hf_weights,
        hf_engine_kv_cache=hf_kv_cache,
        engines_per_gpu=-(-r.num_engines // p.world_size),
        sync_export=0 if on_cpu else sync_export_bytes(config, param_bytes),
        reference=params * param_bytes if config.algorithm.use_kl_loss else 0,
        engines_colocated=r.colocate,
        **_sync_and_save_bytes(config, params, engine),
        gpu=gpu,
    )


def sync_bucket_bytes(config: Config) -> tuple[int, int]:
    """``(largest bucket, largest gathered tensor)`` of a weight sync, in bytes. A bucket
    holds tensors up to ``rollout.weight_sync_bucket_mb``, or one larger tensor alone
    (the embedding or the output layer, ``vocab x hidden``); a stage leader gathers each
    parameter whole before converting it (the embedding with megatron's padded rows,
    ``linear_fc1`` as gate and up together, a layer's experts stacked)."""
    m, p = config.model, config.parallel
    h, param_bytes = m.hidden_size, parameter_bytes(config)
    layers = moe_layers(m)
    dense_mlp = m.ffn_hidden_size * h if not all(layers) else 0
    experts = any(layers)
    largest_sent = max(m.vocab_size * h, dense_mlp, m.num_attention_heads * m.head_dim * h)
    largest_gathered = max(
        padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size) * h,
        2 * dense_mlp,
        qkv_parameters(config),
        m.num_experts * 2 * m.moe_ffn_hidden_size * h if experts else 0,
    )
    bucket = config.rollout.weight_sync_bucket_mb * 2**20
    return max(bucket, largest_sent * param_bytes), largest_gathered * param_bytes


def sync_in_flight_bytes(config: Config) -> int:
    """What a sync holds on a feeder only while it runs, at most. The buckets stream
    through a look-ahead: the one just packed (still referenced by the feeding loop), the
    one held back until the next exists (the last bucket is flagged, for the engines to
    flush their cache), and the one being filled; and while a tensor is gathered over
    tensor parallelism its shards and its whole copy coexist. So with ``tp_size > 1`` (or
    experts, which are stacked): the largest gathered tensor twice plus three buckets.
    With ``tp_size 1`` every tensor is a view of the live weights (no copy) except other
    stages' buckets, received whole (``pp_size > 1``): the largest bucket and two more.
    An upper bound (the buckets next to the largest tensor are rarely full); for experts,
    approximate (a bucket's views keep their whole layer's stack alive)."""
    p = config.parallel
    largest_bucket, largest_gathered = sync_bucket_bytes(config)
    bucket = config.rollout.weight_sync_bucket_mb * 2**20
    if p.tp_size > 1 or any(moe_layers(config.model)):
        return 2 * largest_gathered + 3 * bucket
    return largest_bucket + 2 * bucket if p.pp_size > 1 else 0


def _sync_and_save_bytes(config: Config, params_per_gpu: int, engine: str) -> dict[str, int]:
    """The weight sync's GPU memory on the busiest feeder (kept across syncs, and held only
    while one runs) and the checkpoint save's host memory on a data-parallel rank 0 (see
    :class:`MemoryEstimate`)."""
    p, r = config.parallel, config.rollout
    out = {"checkpoint_host": params_per_gpu * 12 if p.use_distributed_optimizer else 0}
    if p.device == "cpu" or engine != "sglang":
        return out
    largest_bucket, _ = sync_bucket_bytes(config)
    out["sync_in_flight"] = sync_in_flight_bytes(config)
    if r.colocate:
        # Colocated engines of a node share its feeders; the busiest feeds them all at worst.
        engines_per_node = -(-r.num_engines // p.num_nodes)
        out["sync_staging"] = 2 * largest_bucket
        out["sync_engine_copy"] = largest_bucket
        out["engine_contexts"] = engines_per_node * r.engine_tp_size * CUDA_CONTEXT_BYTES
    else:
        out["update_group"] = GIB // 4
    return out


def estimate_host_memory(config: Config, memory: MemoryEstimate) -> HostEstimate:
    """The CPU runtime's memory on one machine; ``memory`` is one rank's estimate."""
    p, r = config.parallel, config.rollout
    _, driver_records, rank_records = routing_record_bytes(config)
    return HostEstimate(
        ranks=p.num_devices_per_node,
        rank_bytes=memory.train_phase,
        engines=-(-r.num_engines // p.num_nodes),
        engine_bytes=memory.hf_engine + CPU_PROCESS_BYTES,
        available=machine_memory_bytes(),
        routing_records=driver_records + p.num_devices_per_node * rank_records,
    )


def routing_record_bytes(config: Config) -> tuple[int, int, int]:
    """Host memory of the engine's routing records (``model.routing_replay`` ``measure`` or
    ``rollout``), at the responses' longest: per token (``moe_layers x moe_router_topk`` ids
    of one or two bytes); on the driver, the kept batch (``train_batch_size`` prompts) and
    the round being generated and scored (``gen_batch_size``) or, streamed, the groups in
    flight and carried (``max_prompts_in_flight`` each; dropped groups let go of theirs);
    on an actor rank, its data-parallel replica's share of the kept batch. Each three
    times over, for the copies that live at once: on the driver the samples' own records,
    the batch's padded grid and the share sent to each replica; on a rank its share, the
    mini-batches split from it and the micro-batches' grids."""
    from dapo_megatron.config import engine_routing, moe_layers
    from dapo_megatron.rollout.routed_experts import bytes_per_token

    m, r, d = config.model, config.rollout, config.data
    if not engine_routing(m):
        return 0, 0, 0
    per_token = bytes_per_token(m.num_experts, sum(moe_layers(m)), m.moe_router_topk)
    round_prompts = d.gen_batch_size or d.train_batch_size
    prompts = d.train_batch_size + ((r.max_prompts_in_flight or round_prompts) * 2 if r.streaming else round_prompts)
    sequence = per_token * r.n_samples_per_prompt * (r.max_prompt_length + r.max_response_length)
    copies = 3
    kept = sequence * d.train_batch_size
    return (
        per_token,
        copies * kept + sequence * (prompts - d.train_batch_size),
        copies * kept // config.parallel.data_parallel_size,
    )


@dataclass
class Problem:
    """One reason a layout does not fit, and the keys whose values decide it."""

    message: str
    keys: tuple[str, ...]


@dataclass
class Plan:
    """What ``plan`` found for one config."""

    config: Config
    num_parameters: int
    padded_vocab: int
    layer_split: list[int]
    memory: MemoryEstimate
    host: Optional[HostEstimate] = None
    """The CPU runtime's whole-machine estimate (``parallel.device=cpu``)."""
    problems: list[Problem] = field(default_factory=list)
    suggestion: Optional[str] = None
    stop: Optional[StopPlan] = None
    """What a stop signal leaves to do, and whether it fits (see :func:`stop_plan`)."""

    @property
    def fits(self) -> bool:
        return not self.problems


SAVE_GB_PER_S_PER_NODE = 1.0
"""The write rate ``plan`` assumes for a checkpoint's writing nodes, each (a shared file
system's per-client rate is of this order; a node with a faster one saves sooner)."""

STOP_CLEANUP_S = 90.0
"""What a stopped run may need after its grace, within the job's ``--signal`` lead time:
the run's own clean-up up to its backstop (60 s, ``run.signals.STOP_BACKSTOP_S``), then
train.sbatch stops Ray (``RAY_STOP_SECONDS``, 20 s) and requeues."""


@dataclass
class StopPlan:
    """The stop after SIGTERM/SIGUSR1 (``trainer.stop_grace_s``): generation is abandoned,
    the actor's work in flight and the save of the last completed step must fit."""

    grace_s: float
    save_bytes: int
    """A checkpoint: the bf16 (or fp32) weights plus the fp32 main weights and Adam's moments."""
    writing_nodes: int
    """Nodes of the first data-parallel replica (its ranks write the checkpoint)."""
    save_s: float
    """The save at :data:`SAVE_GB_PER_S_PER_NODE` on each writing node."""
    signal_lead_s: Optional[float] = None
    """The job's ``--signal`` lead time, when ``plan --signal-lead-s`` gives it."""

    def problems(self) -> list[Problem]:
        found = []
        if self.save_s > self.grace_s:
            found.append(
                Problem(
                    f"a save of {self.save_bytes / 1e9:.0f} GB takes about {self.save_s:.0f} s (at an assumed "
                    f"{SAVE_GB_PER_S_PER_NODE:g} GB/s on each of {self.writing_nodes} writing node(s)), more than "
                    f"trainer.stop_grace_s={self.grace_s:g}: a stop signal would end the run without its save; raise "
                    "trainer.stop_grace_s (and the job's --signal lead time with it)",
                    ("trainer.stop_grace_s",),
                )
            )
        if self.signal_lead_s is not None and self.grace_s + STOP_CLEANUP_S > self.signal_lead_s:
            found.append(
                Problem(
                    f"trainer.stop_grace_s={self.grace_s:g} plus {STOP_CLEANUP_S:g} s to stop the workers exceeds the "
                    f"job's --signal lead time of {self.signal_lead_s:g} s: SLURM would kill the job before it "
                    f"stops and it would not be requeued; set trainer.stop_grace_s at most "
                    f"{self.signal_lead_s - STOP_CLEANUP_S:g} or signal earlier",
                    ("trainer.stop_grace_s",),
                )
            )
        return found


def stop_plan(config: Config, signal_lead_s: Optional[float] = None) -> StopPlan:
    """What a stop signal leaves to do for ``config`` (see :class:`StopPlan`)."""
    p = config.parallel
    params = count_parameters(config)
    save_bytes = params * (parameter_bytes(config) + 12)
    writers = p.model_parallel_size
    writing_nodes = max(1, -(-writers // p.num_devices_per_node)) if p.device != "cpu" else 1
    save_s = save_bytes / (SAVE_GB_PER_S_PER_NODE * 1e9 * writing_nodes)
    return StopPlan(config.trainer.stop_grace_s, save_bytes, writing_nodes, save_s, signal_lead_s)


_ACTOR_KEYS = ("parallel.tp_size", "parallel.pp_size", "parallel.num_nodes", "parallel.num_devices_per_node")
_TRAIN_KEYS = (*_ACTOR_KEYS, "trainer.micro_batch_max_tokens", "model.recompute_activations", "parallel.gpu_memory_gb")
_HF_ENGINE_KEYS = (
    "rollout.num_engines",
    "rollout.max_prompt_length",
    "rollout.max_response_length",
    "data.train_batch_size",
    "data.gen_batch_size",
    "rollout.n_samples_per_prompt",
)
_ENGINE_KEYS = (
    "rollout.num_engines",
    "rollout.engine_tp_size",
    "rollout.gpu_memory_utilization",
    "parallel.gpu_memory_gb",
)


def smallest_sglang_fit(config: Config) -> Optional[str]:
    """What would let one SGLang engine hold its weights and some KV cache: a wider engine
    (fewer engines if colocated) or, at this width, a larger memory fraction."""
    r, p = config.rollout, config.parallel
    gpu = p.gpu_memory_gb * GIB
    weights = count_parameters(config) * 2
    for tp in (2, 4, 8, 16):
        if tp > r.engine_tp_size and weights / tp < r.gpu_memory_utilization * gpu * 0.9:
            engines = f" with rollout.num_engines={p.world_size // tp}" if r.colocate and p.world_size % tp == 0 else ""
            return f"rollout.engine_tp_size={tp}{engines} ({weights / tp / GIB:.2f} GiB of weights per GPU)"
    needed = weights / r.engine_tp_size / gpu / 0.9
    if needed < 0.95:
        return f"rollout.gpu_memory_utilization={math.ceil(needed * 100) / 100:g}"
    return None


def _problems(config: Config, memory: MemoryEstimate, host: Optional[HostEstimate]) -> list[Problem]:
    r, world = config.rollout, config.parallel.world_size
    if host is not None:
        if host.total <= host.available:
            return []
        return [
            Problem(
                f"the CPU run needs {host.total / GIB:.1f} GiB ({host.ranks} ranks x {host.rank_bytes / GIB:.2f} GiB "
                f"+ {host.engines} engines x {host.engine_bytes / GIB:.2f} GiB) > this machine's "
                f"{host.available / GIB:.1f} GiB",
                (*_TRAIN_KEYS, *_HF_ENGINE_KEYS),
            )
        ]
    gpu = int(config.parallel.gpu_memory_gb * GIB)
    problems = []
    if memory.train_phase > gpu:
        problems.append(
            Problem(
                f"train phase needs {memory.train_phase / GIB:.1f} GiB per GPU > parallel.gpu_memory_gb="
                f"{config.parallel.gpu_memory_gb:g} (activations {memory.activations / GIB:.1f} GiB)",
                _TRAIN_KEYS,
            )
        )
    if memory.engine == "sglang" and not memory.sglang_weights_fit:
        fix = smallest_sglang_fit(config)
        problems.append(
            Problem(
                f"one SGLang engine's weights alone ({memory.sglang_weights / GIB:.2f} GiB per GPU at "
                f"rollout.engine_tp_size={r.engine_tp_size}) exceed its rollout.gpu_memory_utilization="
                f"{r.gpu_memory_utilization:g} x {config.parallel.gpu_memory_gb:g} GiB = {memory.sglang / GIB:.2f} GiB"
                + (f"; {fix} would fit them" if fix else ""),
                _ENGINE_KEYS,
            )
        )
    elif memory.rollout_phase > gpu:
        engines = (
            f"SGLang rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}"
            if memory.engine == "sglang"
            else f"{memory.engines_per_gpu} transformers engine(s) of {memory.hf_engine / GIB:.1f} GiB"
        )
        problems.append(
            Problem(
                f"rollout phase needs {memory.rollout_phase / GIB:.1f} GiB per GPU > parallel.gpu_memory_gb="
                f"{config.parallel.gpu_memory_gb:g} ({engines} on top of the resident actor)",
                _ENGINE_KEYS if memory.engine == "sglang" else (*_HF_ENGINE_KEYS, "parallel.gpu_memory_gb"),
            )
        )
    if memory.engine == "sglang" and r.colocate and r.num_engines * r.engine_tp_size != world:
        problems.append(
            Problem(
                f"colocated engines must cover the actor's GPUs: rollout.num_engines x rollout.engine_tp_size = "
                f"{r.num_engines} x {r.engine_tp_size} = {r.num_engines * r.engine_tp_size}, world size {world}",
                (
                    "rollout.num_engines",
                    "rollout.engine_tp_size",
                    "parallel.num_nodes",
                    "parallel.num_devices_per_node",
                ),
            )
        )
    return problems


def _candidate_changes(config: Config) -> list[tuple[str, str]]:
    """Single changes to try, cheapest first: ``(overrides, why)``; a change may need two
    keys that belong together (engine width and engine count)."""
    m, p, r, t = config.model, config.parallel, config.rollout, config.trainer
    changes = []
    world = p.world_size
    sglang = planned_engine(config) == "sglang"  # never on the CPU: validation refuses it
    if sglang and r.colocate and r.num_engines * r.engine_tp_size != world and world % r.engine_tp_size == 0:
        changes.append((f"rollout.num_engines={world // r.engine_tp_size}", "one engine per engine_tp_size GPUs"))
    if not m.recompute_activations:
        changes.append(("model.recompute_activations=true", "recompute activations in backward"))
    if not p.sequence_parallel and p.tp_size > 1 and p.device != "cpu" and m.transformer_impl != "local":
        changes.append(("parallel.sequence_parallel=true", "shard activations over tensor-parallel ranks"))
    longest = r.max_prompt_length + r.max_response_length
    if t.micro_batch_max_tokens // 2 >= longest:
        changes.append((f"trainer.micro_batch_max_tokens={t.micro_batch_max_tokens // 2}", "halve the token budget"))
    if sglang:
        for fraction in (0.8, 0.7, 0.6, 0.5, 0.4):
            if fraction < r.gpu_memory_utilization:
                changes.append((f"rollout.gpu_memory_utilization={fraction}", "give SGLang less memory"))
    elif r.num_engines > 1:
        changes.append((f"rollout.num_engines={r.num_engines // 2}", "half as many transformers engines"))
    changes.append((f"parallel.pp_size={p.pp_size * 2}", "more pipeline stages"))
    if p.tp_size < 8:
        changes.append((f"parallel.tp_size={p.tp_size * 2}", "wider tensor parallelism"))
    if sglang and r.engine_tp_size < 8:
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


def make_plan(config: Config, *, suggest: bool = True, signal_lead_s: Optional[float] = None) -> Plan:
    """Count, place and estimate; on overflow, search for the smallest change that fits.
    With ``signal_lead_s`` (the job's ``--signal`` lead time), also check that a stop
    signal's save fits in it (:func:`stop_plan`)."""
    m, p = config.model, config.parallel
    memory = estimate_memory(config)
    host = estimate_host_memory(config, memory) if p.device == "cpu" else None
    plan = Plan(
        config=config,
        num_parameters=count_parameters(config),
        padded_vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp_size),
        layer_split=p.stage_layers(m.num_layers),
        memory=memory,
        host=host,
        problems=_problems(config, memory, host),
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
            if host is not None:
                plan.suggestion = (
                    f"no single change fits in this machine's {host.available / GIB:.1f} GiB; run on a machine with "
                    f"at least {host.total / GIB:.1f} GiB, or a GPU"
                )
            else:
                plan.suggestion = "no single change fits; use more nodes (parallel.num_nodes)"
    plan.stop = stop_plan(config, signal_lead_s)
    stop_problems = plan.stop.problems()
    if stop_problems:
        plan.problems += stop_problems
        plan.suggestion = plan.suggestion or "trainer.stop_grace_s and the job's --signal lead time (see above)"
    return plan


def network_plan(config: Config) -> str:
    """Which sockets a run of ``config`` listens on, and on which address."""
    p, r = config.parallel, config.rollout
    on_cpu = p.device == "cpu"
    opened = [
        "Ray (GCS, raylet, runtime-env agent, a gRPC port per worker process)"
        if config.ray.address is None
        else "Ray's workers of this job (the cluster's daemons as it was started)",
        "the actor's rendezvous store (rank 0)"
        # megatron's gloo groups: all of them on the CPU, the distributed optimizer's on GPUs.
        + (
            " and gloo's pair listeners (one per gloo group on every rank)"
            if on_cpu or p.use_distributed_optimizer
            else ""
        ),
    ]
    if not r.colocate:
        opened.append(
            "the weight-update group's store (rank 0)" + (" and a listener per engine rank" if on_cpu else "")
        )
    local = config.ray.address is None and p.num_nodes == 1
    where = "127.0.0.1 only" if local else "each node's address as Ray knows it"
    # Not pinned by this project: NCCL chooses its interface (NCCL_SOCKET_IFNAME), SGLang its own.
    note = "" if on_cpu else "; not pinned: NCCL's and SGLang's own listeners (on the interfaces they pick)"
    return f"network: listens on {where}, never 0.0.0.0, on ports picked free at start: " + "; ".join(opened) + note


def _episodes_line(rollout) -> str:
    """What ``plan`` says of multi-turn episodes (``rollout.env``)."""
    from dapo_megatron.sampling.environments import make_environment

    cost = make_environment(rollout.env, rollout.env_options).describe()
    return (
        f"episodes: rollout.env={rollout.env}, at most {rollout.max_turns} model turns in "
        f"{rollout.max_response_length} tokens after the prompt" + (f"; {cost}" if cost else "")
    )


def _routing_line(config: Config) -> str:
    """What ``plan`` says of the engine's routing records (``model.routing_replay``)."""
    per_token, driver, rank = routing_record_bytes(config)
    return (
        f"routing records (model.routing_replay={config.model.routing_replay}): {per_token} bytes per token; "
        f"host memory at the responses' longest: {driver / GIB:.2f} GiB on the driver (the kept batch and the "
        f"groups being generated), {rank / GIB:.2f} GiB on each actor rank (its replica's share)"
    )


def format_plan(plan: Plan) -> str:
    """The table ``dapo-megatron plan`` prints."""
    c, mem, host = plan.config, plan.memory, plan.host
    p, r = c.parallel, c.rollout
    gib = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
    row = lambda label, b: f"  {label:<31}{gib(b)}"  # noqa: E731
    dtype = "fp32" if mem.weights == 4 * mem.parameters else "bf16"
    where = "per CPU rank" if host is not None else "per GPU, heaviest stage"
    if mem.engine == "sglang":
        engines = f"{r.num_engines} SGLang engines x tp {r.engine_tp_size}, gpu_memory_utilization {r.gpu_memory_utilization:g}"
    else:
        engines = f"{r.num_engines} transformers engine(s) (fp32), on the {'CPU' if host is not None else 'GPUs'}"
    experts = ""
    if family_named(c.model.family).moe:
        experts = (
            f"; {c.model.num_experts} experts of width {c.model.moe_ffn_hidden_size} per layer, top "
            f"{c.model.moe_router_topk}: {active_parameters(c):,} active per token"
        )
    expert_layout = ""
    if p.ep_size > 1 or experts:
        expert_layout = (
            f"; experts: ep {p.ep_size} ({c.model.num_experts // p.ep_size} per rank), expert-dp "
            f"{c.parallel.expert_data_parallel_size}"
        )
    lines = [
        f"model: {plan.num_parameters:,} parameters ({c.model.num_layers} layers, hidden {c.model.hidden_size}, "
        f"vocab {c.model.vocab_size} padded to {plan.padded_vocab}{experts})",
        f"layout: world {p.world_size} = tp {p.tp_size} x pp {p.pp_size} x dp {p.data_parallel_size} x cp {p.cp_size}; "
        f"layers per stage {plan.layer_split}; sequence_parallel={p.sequence_parallel}; "
        f"recompute={c.model.recompute_activations}{expert_layout}",
        f"rollout: {engines}",
        *([_episodes_line(c.rollout)] if c.rollout.env is not None else []),
        *([_routing_line(c)] if routing_record_bytes(c)[0] else []),
        f"{where} ({mem.parameters:,} parameters):",
        row(f"weights ({dtype})", mem.weights),
        *([row(f"KL reference policy ({dtype}, frozen)", mem.reference)] if mem.reference else []),
        row("gradients (fp32 buffer)", mem.gradients),
        row(
            f"optimizer (fp32 {'m+v' if dtype == 'fp32' else 'main+m+v'} / {'(e)dp' if experts else 'dp'})",
            mem.optimizer,
        ),
        row(
            f"activations ({c.trainer.micro_batch_max_tokens} tokens x {p.pp_size} in flight, "
            f"{'with' if c.model.recompute_activations else 'without'} recompute)",
            mem.activations,
        ),
        f"    (without recompute {mem.activations_no_recompute / GIB:.2f} GiB, with {mem.activations_recompute / GIB:.2f} GiB)",
        row("log-prob buffers", mem.logprob),
        *([row("weight-sync q/k/v export buffers", mem.sync_export)] if mem.sync_export else []),
        *(
            [row(f"weight-sync staging (2 x {mem.sync_staging / 2 / GIB:.2f} GiB)", mem.sync_staging)]
            if mem.sync_staging
            else []
        ),
        *([row("engine TP workers' CUDA contexts", mem.engine_contexts)] if mem.engine_contexts else []),
        *([row("weight-update communicator", mem.update_group)] if mem.update_group else []),
        row(f"{'process' if host is not None else 'framework'} overhead", mem.overhead),
        row("= train phase", mem.train_phase),
    ]
    if mem.engine == "hf":
        lines.append(
            row(
                f"transformers engine (weights {mem.hf_engine_weights / GIB:.2f} GiB + KV cache "
                f"{mem.hf_engine_kv_cache / GIB:.2f} GiB)",
                mem.hf_engine,
            )
        )
    elif mem.sglang_weights_fit:
        lines.append(
            f"  SGLang {r.gpu_memory_utilization:g} x {p.gpu_memory_gb:g} GiB = weights {mem.sglang_weights / GIB:.2f} GiB "
            f"+ KV cache {mem.sglang_kv_cache / GIB:.2f} GiB ({mem.kv_cache_tokens:,} tokens) {gib(mem.sglang)}"
        )
    else:
        fix = smallest_sglang_fit(c)
        lines.append(
            f"  SGLang {r.gpu_memory_utilization:g} x {p.gpu_memory_gb:g} GiB = {mem.sglang / GIB:.2f} GiB: the weights "
            f"alone ({mem.sglang_weights / GIB:.2f} GiB per GPU) do not fit" + (f"; {fix} would" if fix else "")
        )
    if host is not None:
        lines += [
            f"this machine: {host.ranks} ranks x {host.rank_bytes / GIB:.2f} GiB + {host.engines} engine process(es) x "
            f"{host.engine_bytes / GIB:.2f} GiB = {gib(host.total).strip()} of {host.available / GIB:.1f} GiB",
        ]
    else:
        if mem.sync_transient:
            copy = f"; SGLang's copy of a bucket on the engines' other GPUs {mem.sync_engine_copy / GIB:.2f} GiB"
            lines += [
                row("+ weight sync in flight", mem.sync_transient),
                f"    (while a sync runs, on its feeder: gathered tensors and the buckets around them "
                f"{mem.sync_in_flight / GIB:.2f} GiB{copy if mem.sync_engine_copy else ''})",
            ]
        phase = "= rollout phase" if r.colocate else "= rollout phase (engines on GPUs of their own)"
        lines += [row(phase, mem.rollout_phase), f"GPU memory: {p.gpu_memory_gb:g} GiB"]
        if r.colocate and mem.engine == "sglang":
            resident = mem.rollout_phase - mem.sglang
            lines.append(
                f"actor's allowance next to SGLang's mem_fraction_static={r.gpu_memory_utilization:g}: "
                f"{mem.actor_allowance / GIB:.2f} GiB for {resident / GIB:.2f} GiB resident while engines hold theirs"
            )
    if mem.checkpoint_host:
        per_node = min(p.num_devices_per_node, p.model_parallel_size)
        lines.append(
            f"checkpoint save: each data-parallel rank 0 gathers its shard's fp32 main weights and Adam moments in host "
            f"memory ({mem.checkpoint_host / GIB:.2f} GiB per rank, up to {per_node * mem.checkpoint_host / GIB:.1f} GiB "
            "on a node of the first replica)"
        )
    lines.append(
        f"collective timeout: {p.timeout_minutes:g} min (parallel.timeout_minutes): ranks wait in collectives while "
        "training, computing log-probs, saving and syncing weights, never while the engines generate"
    )
    if plan.stop is not None:
        stop = plan.stop
        lead = (
            f"; the job's --signal lead time {stop.signal_lead_s:g} s"
            if stop.signal_lead_s is not None
            else " (plan --signal-lead-s checks it against the job's --signal lead time)"
        )
        lines.append(
            f"stop on SIGTERM/SIGUSR1: generation in flight is abandoned; the actor's work in flight and the save "
            f"({stop.save_bytes / 1e9:.1f} GB, ~{stop.save_s:.0f} s at an assumed {SAVE_GB_PER_S_PER_NODE:g} GB/s on "
            f"each of {stop.writing_nodes} writing node(s)) must fit in trainer.stop_grace_s={stop.grace_s:g} s{lead}"
        )
    traffic = sync_traffic_plan(c)
    if traffic:
        lines.append(traffic)
    lines.append(network_plan(c))
    if plan.fits:
        lines.append("fits")
    else:
        lines += [f"does not fit: {problem.message}" for problem in plan.problems]
        lines.append(f"smallest change that fits: {plan.suggestion}")
    return "\n".join(lines)
