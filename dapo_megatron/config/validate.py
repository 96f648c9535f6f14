"""The rules that span keys and sections: the layout against the world size and the
model shape, the experts, the algorithm's switches, streaming, the batch sizes against
each other and the sequence lengths, the ``ray`` section. Validation explains and
refuses; it never rewrites another setting.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from dapo_megatron.config.io import ConfigError, ValueSources
from dapo_megatron.config.layout import round_up, sequence_pad_multiple
from dapo_megatron.config.model import MOE_FIELDS, SHAPE_FIELDS
from dapo_megatron.config.sections import Config, RayConfig, RolloutConfig
from dapo_megatron.families import families, family_named


def validate(config: Config, *, sources: Optional[dict[str, str]] = None, default_source: str = "config") -> None:
    """Check the rules that span keys and sections; raise ConfigError on the first broken one."""
    where = ValueSources(sources or {}, default_source)

    def fail(keys: tuple[str, ...], message: str) -> None:
        raise ConfigError(f"{where(*keys)}: {message}")

    _validate_ranges(config, fail)
    _validate_layout(config, fail)
    _validate_algorithm(config, fail)
    _validate_batches(config, fail)
    _validate_ray(config.ray, fail)


def _validate_ranges(config: Config, fail) -> None:
    """Counts and sizes that must be positive, fractions in range."""
    m, p, r, d, t = config.model, config.parallel, config.rollout, config.data, config.trainer

    def positive(section: Any, prefix: str, *names: str) -> None:
        for name in names:
            value = getattr(section, name)
            if value is not None and value < 1:
                fail((f"{prefix}.{name}",), f"{prefix}.{name}={value} must be at least 1")

    positive(
        p,
        "parallel",
        "num_nodes",
        "num_devices_per_node",
        "tp_size",
        "pp_size",
        "dp_size",
        "cp_size",
        "ep_size",
        "timeout_minutes",
    )
    positive(
        m,
        "model",
        *[n for n in SHAPE_FIELDS if n not in ("family", "rms_norm_eps", "rope_theta", "tie_word_embeddings")],
        *[n for n in MOE_FIELDS if n not in ("moe_norm_topk_prob", "mlp_only_layers")],
        "make_vocab_size_divisible_by",
    )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(m, name)
        if value is not None and value < 0:
            fail((f"model.{name}",), f"model.{name}={value} must be >= 0 (0 turns the loss off)")
    positive(
        r,
        "rollout",
        "stream_chunk_tokens",
        "n_samples_per_prompt",
        "max_prompt_length",
        "max_response_length",
        "num_engines",
        "engine_tp_size",
        "weight_sync_bucket_mb",
        "val_n_samples",
    )
    if not 0 < r.gpu_memory_utilization < 1:
        fail(
            ("rollout.gpu_memory_utilization",),
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1)",
        )
    if p.gpu_memory_gb <= 0:
        fail(("parallel.gpu_memory_gb",), f"parallel.gpu_memory_gb={p.gpu_memory_gb} must be > 0")
    positive(d, "data", "train_batch_size", "gen_batch_size", "mini_batch_size")
    positive(t, "trainer", "num_steps", "micro_batch_max_tokens", "stop_grace_s")
    # Counts where 0 means "never" or "all"; a negative one has no meaning (a negative
    # keep_last would delete the newest checkpoints).
    for dotted, meaning in (
        ("checkpoint.save_every", "0 disables saving"),
        ("checkpoint.keep_last", "0 keeps every checkpoint"),
        ("trainer.val_every", "0 disables validation during the run"),
        ("logging.log_every", "0 and 1 print every step"),
        ("rollout.generate_timeout_s", "0 derives the bound from rollout.max_response_length"),
        ("rollout.weight_sync_timeout_s", "0 derives the bound from rollout.weight_sync_bucket_mb"),
    ):
        section, name = dotted.split(".")
        value = getattr(getattr(config, section), name)
        if value < 0:
            fail((dotted,), f"{dotted}={value} must be >= 0 ({meaning})")


def _nearest(candidates: Any, value: int, key: str) -> str:
    """``"; nearest valid key: 2 or 4"``: the closest candidates below and above ``value``."""
    below = [c for c in candidates if c < value]
    above = [c for c in candidates if c > value]
    nearest = ([max(below)] if below else []) + ([min(above)] if above else [])
    return f"; nearest valid {key}: {' or '.join(str(n) for n in nearest)}" if nearest else ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_LAYOUT_KEYS = (
    "parallel.tp_size",
    "parallel.pp_size",
    "parallel.cp_size",
    "parallel.num_nodes",
    "parallel.num_devices_per_node",
)


def _validate_layout(config: Config, fail) -> None:
    """The layout against the world size and against the model shape."""
    m, p = config.model, config.parallel
    if m.family not in families():
        fail(
            ("model.family", "model.hf_config"),
            f"model.family={m.family!r} is not a supported model family; supported: {', '.join(families())}",
        )
    model_parallel = p.model_parallel_size
    heads_and_groups = [t for t in _divisors(m.num_attention_heads) if m.num_query_groups % t == 0]
    if p.dp_size is None:
        if p.world_size % model_parallel:
            others = p.pp_size * p.cp_size
            valid_tp = [t for t in heads_and_groups if p.world_size % (t * others) == 0]
            fail(
                _LAYOUT_KEYS,
                f"world size {p.world_size} (parallel.num_nodes={p.num_nodes} x "
                f"parallel.num_devices_per_node={p.num_devices_per_node}) must be divisible by "
                f"tp_size*pp_size*cp_size={p.tp_size}*{p.pp_size}*{p.cp_size}={model_parallel}"
                + _nearest(valid_tp, p.tp_size, "parallel.tp_size"),
            )
    elif p.world_size != model_parallel * p.dp_size:
        hint = ""
        if p.world_size % model_parallel == 0:
            hint = f"; with this tp, pp and cp: parallel.dp_size={p.world_size // model_parallel} (or unset it)"
        fail(
            ("parallel.dp_size", *_LAYOUT_KEYS),
            f"world size {p.world_size} (parallel.num_nodes={p.num_nodes} x "
            f"parallel.num_devices_per_node={p.num_devices_per_node}) must equal "
            f"tp_size*pp_size*dp_size*cp_size={p.tp_size}*{p.pp_size}*{p.dp_size}*{p.cp_size}"
            f"={model_parallel * p.dp_size}{hint}",
        )
    _validate_experts(config, fail)
    if p.sequence_parallel and p.tp_size == 1:
        fail(("parallel.sequence_parallel",), "parallel.sequence_parallel=true needs parallel.tp_size > 1")

    if m.num_attention_heads % p.tp_size:
        fail(
            ("parallel.tp_size", "model.num_attention_heads"),
            f"parallel.tp_size={p.tp_size} must divide model.num_attention_heads={m.num_attention_heads}"
            + _nearest(heads_and_groups, p.tp_size, "parallel.tp_size"),
        )
    if m.num_query_groups % p.tp_size:
        fail(
            ("parallel.tp_size", "model.num_query_groups"),
            f"parallel.tp_size={p.tp_size} must divide model.num_query_groups={m.num_query_groups}"
            + _nearest(heads_and_groups, p.tp_size, "parallel.tp_size"),
        )
    if m.num_attention_heads % m.num_query_groups:
        fail(
            ("model.num_query_groups", "model.hf_config"),
            f"model.num_query_groups={m.num_query_groups} must divide model.num_attention_heads={m.num_attention_heads}",
        )
    uneven = p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None
    if uneven and p.pp_size == 1:
        fail(
            ("parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage"),
            "uneven pipeline stages are set but parallel.pp_size=1",
        )
    try:
        p.stage_layers(m.num_layers)
    except ValueError:
        if not uneven:
            fail(
                ("parallel.pp_size", "model.num_layers"),
                f"parallel.pp_size={p.pp_size} must divide model.num_layers={m.num_layers} "
                f"(or set parallel.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage)"
                + _nearest(_divisors(m.num_layers), p.pp_size, "parallel.pp_size"),
            )
        fail(
            ("parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage"),
            f"parallel.num_layers_in_first_pipeline_stage={p.num_layers_in_first_pipeline_stage} and "
            f"num_layers_in_last_pipeline_stage={p.num_layers_in_last_pipeline_stage} leave "
            f"model.num_layers={m.num_layers} minus those layers, which must split evenly over the "
            f"remaining stages of parallel.pp_size={p.pp_size}, each stage keeping at least one layer",
        )
    if p.pp_size > m.num_layers:
        fail(("parallel.pp_size",), f"parallel.pp_size={p.pp_size} exceeds model.num_layers={m.num_layers}")
    if m.hidden_size % m.num_attention_heads:
        fail(
            ("model.hidden_size",),
            f"model.num_attention_heads={m.num_attention_heads} must divide model.hidden_size={m.hidden_size}",
        )
    if m.fp8 and m.transformer_impl == "local":
        fail(("model.fp8",), "model.fp8=true needs model.transformer_impl=transformer_engine or auto")
    if p.device == "cpu" and config.rollout.engine == "sglang":
        fail(
            ("rollout.engine", "parallel.device"),
            "rollout.engine=sglang needs a GPU but parallel.device=cpu; use rollout.engine=hf (or auto)",
        )
    if p.device == "cpu" and (m.fp8 or m.transformer_impl == "transformer_engine"):
        fail(
            ("model.transformer_impl", "model.fp8"),
            f"model.transformer_impl={m.transformer_impl} / model.fp8={m.fp8} need a GPU but parallel.device=cpu",
        )


_ROUTER_LOSSES = ("moe_aux_loss_coeff", "moe_z_loss_coeff")


EXPERT_SETTINGS = (*MOE_FIELDS, *_ROUTER_LOSSES)
"""The model keys that act only on a family with experts (refused on a dense one)."""


def _validate_experts(config: Config, fail) -> None:
    """The mixture-of-experts shape and ``parallel.ep_size`` against it and the layout."""
    m, p = config.model, config.parallel
    if m.family not in families() or not family_named(m.family).moe:
        # What a dense model's config holds anyway (also in the resolved config written into
        # a run folder): experts unset, router losses off. Anything else would be ignored.
        ignored = [
            name
            for name in EXPERT_SETTINGS
            if getattr(m, name) is not None and not (name in _ROUTER_LOSSES and getattr(m, name) == 0)
        ]
        if m.routing_replay != "off":
            ignored.append("routing_replay")
        if ignored:
            keys = tuple(f"model.{name}" for name in ignored)
            moe_families = ", ".join(name for name, family in families().items() if family.moe)
            fail(
                keys,
                f"{', '.join(f'model.{name}={getattr(m, name)!r}' for name in ignored)} would be ignored: "
                f"model.family={m.family!r} is a dense family with no experts (mixture-of-experts families: "
                f"{moe_families}); remove {', '.join(keys)}, or point model.hf_config at a mixture-of-experts model",
            )
        if p.ep_size != 1:
            fail(
                ("parallel.ep_size", "model.hf_config"),
                f"parallel.ep_size={p.ep_size} needs a mixture-of-experts model, but model.family={m.family!r} "
                f"has no experts; set parallel.ep_size=1",
            )
        return
    if m.moe_router_topk > m.num_experts:
        fail(
            ("model.moe_router_topk", "model.num_experts"),
            f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}",
        )
    out_of_range = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if out_of_range:
        fail(
            ("model.mlp_only_layers",),
            f"model.mlp_only_layers={m.mlp_only_layers} names layers {out_of_range} outside 0..{m.num_layers - 1}",
        )
    if p.tp_size > 1 and not p.sequence_parallel:
        fail(
            ("parallel.sequence_parallel", "parallel.tp_size"),
            f"a mixture-of-experts model at parallel.tp_size={p.tp_size} needs parallel.sequence_parallel=true "
            "(megatron's token dispatcher assumes each tensor-parallel rank holds different tokens); set it",
        )
    if m.num_experts % p.ep_size:
        fail(
            ("parallel.ep_size", "model.num_experts"),
            f"parallel.ep_size={p.ep_size} must divide model.num_experts={m.num_experts}"
            + _nearest(_divisors(m.num_experts), p.ep_size, "parallel.ep_size"),
        )
    if m.routing_replay == "old" and config.algorithm.use_rollout_log_probs:
        fail(
            ("model.routing_replay", "algorithm.use_rollout_log_probs"),
            "model.routing_replay=old replays the routing of the actor's old-log-prob pass, which "
            "algorithm.use_rollout_log_probs=true skips: use model.routing_replay=rollout (the engine's routing), "
            "or compute the old log-probs",
        )
    stage_ranks = p.tp_size * p.cp_size * p.data_parallel_size
    if stage_ranks % p.ep_size:
        valid = [e for e in _divisors(m.num_experts) if stage_ranks % e == 0]
        fail(
            ("parallel.ep_size", "parallel.tp_size", "parallel.dp_size", "parallel.num_devices_per_node"),
            f"parallel.ep_size={p.ep_size} must divide the ranks of a pipeline stage, "
            f"tp_size*cp_size*dp_size={p.tp_size}*{p.cp_size}*{p.data_parallel_size}={stage_ranks}"
            + _nearest(valid, p.ep_size, "parallel.ep_size"),
        )


def _validate_algorithm(config: Config, fail) -> None:
    """The DAPO knobs."""
    a, r = config.algorithm, config.rollout
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(a, name)
        if not 0 <= value < 1 and name == "clip_ratio_low":
            fail((f"algorithm.{name}",), f"algorithm.{name}={value} must be in [0, 1)")
        if value < 0:
            fail((f"algorithm.{name}",), f"algorithm.{name}={value} must be >= 0")
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
        fail(("algorithm.clip_ratio_c",), f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual clip bound)")
    if a.max_num_gen_batches < 0:
        fail(
            ("algorithm.max_num_gen_batches",),
            f"algorithm.max_num_gen_batches={a.max_num_gen_batches} must be >= 0 (0 = unlimited)",
        )
    if a.overlong_buffer_enable and not 0 < a.overlong_buffer_len < r.max_response_length:
        fail(
            ("algorithm.overlong_buffer_len", "rollout.max_response_length"),
            f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be > 0 and below "
            f"rollout.max_response_length={r.max_response_length}",
        )
    if a.use_kl_loss and not (math.isfinite(a.kl_loss_coef) and a.kl_loss_coef > 0):
        fail(
            ("algorithm.kl_loss_coef",),
            f"algorithm.kl_loss_coef={a.kl_loss_coef} must be > 0 when algorithm.use_kl_loss=true",
        )
    if not math.isfinite(a.reward_error_score):
        fail(("algorithm.reward_error_score",), f"algorithm.reward_error_score={a.reward_error_score} must be finite")
    if a.reward_timeout_s <= 0:
        fail(("algorithm.reward_timeout_s",), f"algorithm.reward_timeout_s={a.reward_timeout_s} must be > 0")
    if a.reward_worker_memory_mb < 0:
        fail(
            ("algorithm.reward_worker_memory_mb",),
            f"algorithm.reward_worker_memory_mb={a.reward_worker_memory_mb} must be >= 0 (0 = no cap)",
        )
    if config.trainer.async_generation and r.colocate and config.parallel.device == "cuda":
        fail(
            ("trainer.async_generation", "rollout.colocate", "parallel.device"),
            "trainer.async_generation=true generates while the actor trains, which needs engines on GPUs of their "
            "own: set rollout.colocate=false (on the CPU runtime, engines get cores of their own)",
        )
    _validate_streaming(config, fail)
    _validate_episodes(config, fail)
    _validate_logging(config, fail)
    if not a.rollout_correction_cap > 1:
        fail(
            ("algorithm.rollout_correction_cap",),
            f"algorithm.rollout_correction_cap={a.rollout_correction_cap} must be > 1 (ratios in [1/C, C] are kept)",
        )
    if a.use_rollout_log_probs and a.rollout_correction not in ("none", "auto"):
        fail(
            ("algorithm.use_rollout_log_probs", "algorithm.rollout_correction"),
            f"algorithm.rollout_correction={a.rollout_correction} weighs by exp(old - rollout), which is 1 when "
            "algorithm.use_rollout_log_probs=true makes the rollout's log-probs the old ones; set one of them off",
        )


def _validate_streaming(config: Config, fail) -> None:
    """Streamed generation's switches against each other and the other modes."""
    r = config.rollout
    for name in ("carry_over", "partial_rollout"):
        if getattr(r, name) and not r.streaming:
            fail(
                (f"rollout.{name}", "rollout.streaming"),
                f"rollout.{name}=true works on streamed generation: set rollout.streaming=true as well",
            )
    if r.streaming and config.trainer.async_generation:
        fail(
            ("rollout.streaming", "trainer.async_generation"),
            "rollout.streaming and trainer.async_generation do not combine (yet): set one of them off; carry_over "
            "and partial_rollout give streaming its own off-policy overlap",
        )
    defaults = RolloutConfig()
    if not r.streaming:
        for name in ("max_prompts_in_flight", "stream_chunk_tokens"):
            if getattr(r, name) != getattr(defaults, name):
                fail(
                    (f"rollout.{name}", "rollout.streaming"),
                    f"rollout.{name}={getattr(r, name)} acts only on streamed generation: set "
                    "rollout.streaming=true, or leave it at its default",
                )
    if r.max_staleness != defaults.max_staleness and not r.carries_over:
        fail(
            ("rollout.max_staleness",),
            f"rollout.max_staleness={r.max_staleness} acts only on carried groups and partial responses: set "
            "rollout.carry_over or rollout.partial_rollout (with rollout.streaming), or leave it at its default",
        )
    if r.max_prompts_in_flight < 0:
        fail(
            ("rollout.max_prompts_in_flight",),
            f"rollout.max_prompts_in_flight={r.max_prompts_in_flight} must be >= 0 (0 = data.gen_batch_size)",
        )
    if r.max_staleness < 1 and r.carries_over:
        fail(
            ("rollout.max_staleness",),
            f"rollout.max_staleness={r.max_staleness} must be >= 1 with carry_over or partial_rollout (what is "
            "carried is trained at least one version later)",
        )


def _validate_logging(config: Config, fail) -> None:
    """The rollout records' bounds; W&B settings only with W&B on."""
    lg = config.logging
    defaults = type(lg)()
    if not lg.wandb:
        changed = [
            name
            for name in ("wandb_project", "wandb_entity", "wandb_name", "wandb_tags", "wandb_mode", "wandb_table_every")
            if getattr(lg, name) != getattr(defaults, name)
        ]
        if changed:
            fail(
                tuple(f"logging.{name}" for name in changed) + ("logging.wandb",),
                f"logging.{changed[0]} acts only with logging.wandb=true: set it, or remove the W&B settings",
            )
    if lg.wandb_table_every < 0:
        fail(("logging.wandb_table_every",), f"logging.wandb_table_every={lg.wandb_table_every} must be >= 0 (0: none)")
    for name in ("rollout_records_every", "rollout_records_groups"):
        if getattr(lg, name) < 0:
            fail(
                (f"logging.{name}",),
                f"logging.{name}={getattr(lg, name)} must be >= 0 (0: {'none' if name.endswith('every') else 'all'})",
            )


def _validate_episodes(config: Config, fail) -> None:
    """Multi-turn rollouts' settings (``rollout.env``; its name is resolved by the run's
    pre-flight, which can import it)."""
    r = config.rollout
    if r.max_turns < 1:
        fail(("rollout.max_turns",), f"rollout.max_turns={r.max_turns} must be >= 1")
    if r.env is None:
        if r.max_turns != RolloutConfig().max_turns:
            fail(
                ("rollout.max_turns", "rollout.env"),
                f"rollout.max_turns={r.max_turns} acts only on multi-turn episodes: set rollout.env, or leave it "
                "at its default",
            )
        if r.observation_format != RolloutConfig().observation_format:
            fail(
                ("rollout.observation_format", "rollout.env"),
                f"rollout.observation_format={r.observation_format} acts only on multi-turn episodes: set "
                "rollout.env, or leave it at its default",
            )
        if r.env_options:
            fail(
                ("rollout.env_options", "rollout.env"),
                f"rollout.env_options={r.env_options} configure a multi-turn environment: set rollout.env, or remove "
                "them",
            )
        return


def _validate_batches(config: Config, fail) -> None:
    """Batch sizes against each other, the layout and the sequence lengths; the optimizer."""
    p, r, a, d, t = config.parallel, config.rollout, config.algorithm, config.data, config.trainer
    num_responses = d.train_batch_size * r.n_samples_per_prompt
    dp_size = p.data_parallel_size
    valid_mini = [b for b in _divisors(num_responses) if b % dp_size == 0]
    if num_responses % d.mini_batch_size:
        fail(
            ("data.mini_batch_size", "data.train_batch_size", "rollout.n_samples_per_prompt"),
            f"data.mini_batch_size={d.mini_batch_size} must divide data.train_batch_size x "
            f"rollout.n_samples_per_prompt = {d.train_batch_size} x {r.n_samples_per_prompt} = {num_responses}"
            + _nearest(valid_mini, d.mini_batch_size, "data.mini_batch_size"),
        )
    if d.mini_batch_size % dp_size:
        fail(
            ("data.mini_batch_size", "parallel.dp_size", *_LAYOUT_KEYS),
            f"data.mini_batch_size={d.mini_batch_size} must be divisible by the data-parallel size {dp_size}"
            + _nearest(valid_mini, d.mini_batch_size, "data.mini_batch_size"),
        )
    if d.gen_batch_size is not None and d.gen_batch_size < d.train_batch_size and not a.dynamic_sampling:
        fail(
            ("data.gen_batch_size", "data.train_batch_size", "algorithm.dynamic_sampling"),
            f"data.gen_batch_size={d.gen_batch_size} is below data.train_batch_size={d.train_batch_size} without dynamic sampling",
        )
    # The longest sequence as the actor's planners see it: a row rounded up to the pad multiple.
    longest = r.max_prompt_length + r.max_response_length
    pad_multiple = sequence_pad_multiple(p.tp_size, p.sequence_parallel, config.model.fp8)
    width = round_up(longest, pad_multiple)
    if t.micro_batch_max_tokens < width:
        keys = ("trainer.micro_batch_max_tokens", "rollout.max_prompt_length", "rollout.max_response_length")
        rounded = ""
        if width != longest:
            reason = "model.fp8" if config.model.fp8 else "parallel.sequence_parallel"
            keys += ("parallel.tp_size", reason)
            rounded = (
                f", a row of {width} once rounded up to the sequence pad multiple {pad_multiple} "
                f"(parallel.tp_size={p.tp_size} with {reason}=true)"
            )
        fail(
            keys,
            f"trainer.micro_batch_max_tokens={t.micro_batch_max_tokens} must hold one full sequence: "
            f"rollout.max_prompt_length + rollout.max_response_length = {longest} tokens{rounded}; set "
            f"trainer.micro_batch_max_tokens to at least {width}",
        )
    if t.lr <= 0:
        fail(("trainer.lr",), f"trainer.lr={t.lr} must be > 0")
    if t.grad_clip < 0:
        fail(("trainer.grad_clip",), f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if t.max_bad_steps_in_a_row < 0:
        fail(
            ("trainer.max_bad_steps_in_a_row",),
            f"trainer.max_bad_steps_in_a_row={t.max_bad_steps_in_a_row} must be >= 0 (0 = never stop)",
        )
    if t.lr_warmup_steps < 0:
        fail(("trainer.lr_warmup_steps",), f"trainer.lr_warmup_steps={t.lr_warmup_steps} must be >= 0")


def _validate_ray(ray: RayConfig, fail) -> None:
    """Rules of the ``ray`` section."""
    if ray.num_cpus is not None and ray.num_cpus < 1:
        fail(("ray.num_cpus",), f"ray.num_cpus={ray.num_cpus} must be at least 1")
    if ray.engine_num_threads < 0:
        fail(("ray.engine_num_threads",), f"ray.engine_num_threads={ray.engine_num_threads} must be >= 0")
    if ray.address is not None and not ray.address.strip():
        fail(("ray.address",), "ray.address is empty; unset it to start a local Ray instance")
