"""Typed run configuration: one dataclass per component, loaded strictly from YAML.

Every setting of a run lives here, with its type, its default and a docstring, so that a
misspelt key or a value of the wrong type is refused before any process starts instead of
being ignored or discovered an hour into a job. A config is built in three steps:

1. read the YAML file (a mapping of sections), resolve its relative paths against the
   file's folder, apply dotted ``key=value`` overrides (their paths against the current
   directory);
2. check every key and type against the dataclasses (unknown key, wrong type: refused);
3. fill the model shape from the HF ``config.json`` when one is named, then check the
   cross-section rules (layout against world size and model shape, batch divisibility).

Errors are :class:`ConfigError` and name where the value came from, the key, the value
and the rule, e.g. ``run.yaml: parallel.tp_size=3 must divide model.num_attention_heads=40``.
Validation explains and refuses; it never rewrites another setting. The generic typed-YAML
machinery (strict building, overrides, ``ConfigError``) lives in :mod:`config_io`; nothing
else of the package is imported.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from dapo_megatron.config_io import COMMAND_LINE, ConfigError, apply_override, build_dataclass
from dapo_megatron.families import families, family_named
from dapo_megatron.model_config import (  # noqa: F401  (re-exported: the config's public names)
    _SHAPE_FIELDS,
    MOE_FIELDS,
    ModelConfig,
    moe_layers,
    padded_vocab_size,
    read_hf_model_shape,
    resolve_model_shape,
)
from dapo_megatron.sequence_pad import round_up, sequence_pad_multiple

# --------------------------------------------------------------------------- sections


@dataclass
class ParallelConfig:
    """How the actor is laid out over devices (or, on CPU, processes)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the actor runs: ``cuda`` (NCCL), ``cpu`` (gloo, megatron-core redirected to the
    CPU), or ``auto`` (CUDA when a GPU exists, else the CPU)."""
    num_nodes: int = 1
    """Number of nodes of the run."""
    num_devices_per_node: int = 1
    """GPUs per node (on the CPU runtime: processes per node). World size is
    ``num_nodes * num_devices_per_node``."""
    tp_size: int = 1
    """Tensor-parallel size: splits attention heads, query groups and the vocabulary."""
    pp_size: int = 1
    """Pipeline-parallel size: splits the layers into consecutive stages."""
    dp_size: Optional[int] = None
    """Data-parallel size; when unset it is the world size divided by tp*pp*cp."""
    cp_size: int = 1
    """Context-parallel size: splits long sequences."""
    ep_size: int = 1
    """Expert-parallel size (mixture-of-experts families): splits each layer's experts
    over this many ranks, carved out of the tp x cp x dp ranks of a pipeline stage (each
    expert whole on its rank: expert-tensor-parallel size 1), tokens exchanged by an
    all-to-all. Must divide ``model.num_experts`` and ``tp_size * cp_size * dp_size``."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside tensor-parallel regions (needs tp_size > 1)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline split: layers on the first stage (the rest are split evenly)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline split: layers on the last stage (the rest are split evenly)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer)."""
    timeout_minutes: int = 30
    """Collective timeout; a hung rank fails the run after this long."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (H100/H200 80 GB class by default), for ``dapo-megatron plan``."""

    @property
    def world_size(self) -> int:
        """Total number of ranks of the actor."""
        return self.num_nodes * self.num_devices_per_node


@dataclass
class RolloutConfig:
    """Response generation by the rollout engines."""

    engine: Literal["auto", "sglang", "hf"] = "auto"
    """Engine: SGLang on GPU, transformers (``hf``) on CPU; ``auto`` picks by device."""
    n_samples_per_prompt: int = 16
    """Responses sampled per prompt (the group size G of the advantage)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold for training rollouts."""
    top_k: int = -1
    """Top-k sampling for training rollouts; -1 disables it."""
    max_prompt_length: int = 2048
    """Longest prompt in tokens; longer prompts are refused by the data loader."""
    max_response_length: int = 20480
    """Longest response in tokens (L_max); a response that reaches it is truncated."""
    num_engines: int = 1
    """Number of rollout engine instances."""
    engine_tp_size: int = 1
    """Tensor-parallel size of each rollout engine."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory an SGLang engine may use for weights and KV cache."""
    colocate: bool = True
    """Engines share the actor's devices (memory released while the actor trains) and
    receive weights by handle (CUDA IPC on GPU, shared memory on the CPU); false: engines
    on their own devices receive weights by broadcast over a weight-update group."""
    weight_sync_bucket_mb: int = 512
    """Size of the buckets in which weights are streamed to the engines."""
    generate_timeout_s: float = 0.0
    """The longest one generation call on an engine (its share of a round, or a streamed
    tick) may take before the run fails naming the engine as hung (with the ``--resume``
    hint), instead of holding the job until its time limit. 0 = derived from the work:
    600 s plus ``max_response_length`` tokens at 5 tokens/s per row (the 32B recipe's
    20,480 tokens: 78 minutes)."""
    weight_sync_timeout_s: float = 0.0
    """The longest one call of a weight update on an engine may take (opening the
    session, taking one bucket, closing or aborting it) before the run fails naming the
    engine. 0 = derived from the bytes moved: 120 s plus one ``weight_sync_bucket_mb``
    bucket at 10 MB/s."""
    seed: int = 1234
    """Seed of the rollout samplers (a distinct one per step, round and engine; SGLang
    gives each response row its own on top). The transformers engine reproduces its
    samples from it; SGLang only with ``deterministic_inference``."""
    deterministic_inference: bool = False
    """SGLang's deterministic inference (``enable_deterministic_inference``): the per-row
    seeds are honoured and a rerun on the same GPUs and SGLang release samples the same
    responses; slower kernels. Off: SGLang ignores the seeds."""
    streaming: bool = False
    """Streaming dynamic sampling: engines hand back each group (a prompt's ``n``
    responses) as soon as its last response ends; groups are scored and filtered as they
    arrive, prompts are fed only while the kept groups are short of
    ``data.train_batch_size``, and what is still generating when the batch is full is
    aborted. Off: generation in rounds of ``data.gen_batch_size`` prompts, each ending
    with its longest response (docs/performance.md: streamed generation)."""
    max_prompts_in_flight: int = 0
    """Streaming: how much generates at once over all engines (shared evenly, at least one
    prompt per engine), in prompts' worth of rows: a group counts by its rows still
    generating, so a prompt with one straggler row takes 1/n of a place and more prompts
    than this can be open. 0 = ``data.gen_batch_size`` (or ``data.train_batch_size``).
    Enough keeps every engine busy; more makes the abort throw away (or carry) more."""
    stream_chunk_tokens: int = 64
    """Streaming, transformers engine: tokens generated per row between two checks
    (completed groups handed back, new prompts taken, abort). SGLang generates each
    request on its own; a check there waits for the next request to finish."""
    carry_over: bool = False
    """Streaming: kept groups beyond the batch start the next step's batch instead of
    being dropped (at most ``max_staleness`` policy versions old, corrected by
    ``algorithm.rollout_correction``); part of a checkpoint's state."""
    partial_rollout: bool = False
    """Streaming: a response still generating at the abort keeps its tokens and their
    sampling log-probs and continues in the next step under the new weights; every token
    records the policy version that sampled it. Part of a checkpoint's state."""
    max_staleness: int = 1
    """Carried groups and partial responses: the most policy versions a trained token may
    lag the actor (a group whose oldest token is older is dropped, and counted)."""
    val_n_samples: int = 32
    """Responses per validation prompt (avg@32 for AIME)."""
    val_temperature: float = 1.0
    """Sampling temperature for validation."""
    val_top_p: float = 0.7
    """Nucleus sampling threshold for validation."""


@dataclass
class AlgorithmConfig:
    """The DAPO objective and its five techniques (see docs/algorithm.md)."""

    clip_ratio_low: float = 0.2
    """epsilon_low of the decoupled clip: ratios below 1 - clip_ratio_low are clipped."""
    clip_ratio_high: float = 0.28
    """epsilon_high of the decoupled clip (Clip-Higher)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound for negative advantages (e.g. 3.0); unset disables it."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses are aggregated: DAPO's global token mean, or the ablations."""
    advantage_eps: float = 1e-6
    """Added to the group standard deviation of the rewards."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more until the batch is full."""
    max_num_gen_batches: int = 10
    """Generation rounds allowed to fill one batch under dynamic sampling; 0 = unlimited."""
    overlong_filter: bool = False
    """Mask truncated responses out of the loss."""
    overlong_buffer_enable: bool = True
    """Add the soft overlong punishment to the reward."""
    overlong_buffer_len: int = 4096
    """L_cache of the soft overlong punishment, in tokens."""
    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong punishment."""
    reward_fn: str = "dapo_math"
    """Reward function: a registered name (``dapo_math``, ``math_verify``) or ``module:function``."""
    reward_timeout_s: float = 5.0
    """Time bound of one reward call; a call that exceeds it scores as wrong."""
    reward_worker_memory_mb: int = 4096
    """Memory cap of each reward worker process (the processes that run reward functions
    not bounded by construction, e.g. ``math_verify`` or ``module:function``), in MiB of
    address space beyond what the worker has mapped once Python and its imports are up; 0
    = no cap. A call that allocates past it gets a ``MemoryError`` and scores as a reward
    error (``reward_error_score``, counted in ``reward/errors``) instead of running the
    machine out of memory."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef`` x KL(π_θ ‖ π_ref) to the loss, π_ref being the initial policy
    (the run's initial weights, held frozen by every actor rank without gradients or
    optimizer state: one more copy of the weights per rank, see ``plan``). GRPO's penalty;
    DAPO uses none. Needs initial weights (``model.hf_weights`` or ``checkpoint.load_dir``)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL penalty (with ``use_kl_loss``)."""
    kl_loss_type: Literal["k1", "k3", "low_var_kl"] = "low_var_kl"
    """Per-token KL estimator: ``k1`` = log π_θ - log π_ref; ``k3`` = r - log r - 1 with
    r = π_ref / π_θ (>= 0, lower variance); ``low_var_kl`` = ``k3`` clamped to [-10, 10]."""
    reward_error_score: float = -1.0
    """The score of a reward call that raises, returns something that is not a number
    (or a NaN or infinite one) or exceeds ``reward_timeout_s``: not correct, counted in
    ``reward/errors`` or ``reward/timeouts``. The default is the built-in rewards' wrong
    answer."""
    rollout_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Correction of the training-inference mismatch, with ``r = exp(old - rollout)`` (the
    actor's old log-prob minus the engine's sampling log-prob): ``tis`` weighs each token's
    loss by ``min(r, C)``; ``mis`` keeps only tokens with ``r`` in ``[1/C, C]``; ``none``;
    ``auto``: ``tis`` with ``trainer.async_generation``, ``rollout.carry_over`` or
    ``rollout.partial_rollout`` (unless ``use_rollout_log_probs``),
    else ``none``."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """``token``: each token's own ratio; ``sequence``: the product over the response,
    applied to all its tokens."""
    rollout_correction_cap: float = 2.0
    """``C`` of ``rollout_correction`` and of the ``rollout_mismatch/ratio_outside_cap_share``
    metric (> 1)."""
    use_rollout_log_probs: bool = False
    """Take the engine's sampling log-probs as the old policy and skip the actor's old
    log-prob pass (faster; the PPO ratio then includes the mismatch, and the mismatch
    metrics are not computed)."""


@dataclass
class DataConfig:
    """Prompts and the batch sizes that consume them."""

    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files of training prompts (DAPO-Math schema)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files of validation prompts."""
    tokenizer: Optional[str] = None
    """Folder of an HF tokenizer; defaults to the model's folder."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or text)."""
    answer_key: str = "reward_model.ground_truth"
    """Column holding the reference answer (dotted for nested fields)."""
    train_batch_size: int = 512
    """Prompts per rollout step that survive dynamic sampling."""
    gen_batch_size: Optional[int] = None
    """Prompts generated per round under dynamic sampling; defaults to ``train_batch_size``."""
    mini_batch_size: int = 512
    """Responses per gradient update; ``train_batch_size * n_samples_per_prompt`` must be
    a multiple of it."""
    data_source_key: str = "data_source"
    """Column naming each prompt's data source (metrics are also reported per source);
    a file without it reports its file name as the source."""
    deduplicate: bool = False
    """Keep one copy of prompts that repeat with the same answer (the published
    ``dapo-math-17k.parquet`` repeats each of its 17k prompts 100 times); the loader always
    reports how many distinct prompts a file holds."""
    shuffle: bool = True
    """Shuffle the prompts every epoch."""
    seed: int = 42
    """Seed of the prompt shuffling."""


@dataclass
class TrainerConfig:
    """The training loop and the optimizer."""

    seed: int = 1234
    """Seed of model init and of megatron's RNG trackers."""
    num_steps: int = 1000
    """Rollout steps to run."""
    micro_batch_max_tokens: int = 32768
    """Token budget of one micro-batch: the tokens of its packed row (``pack_sequences``),
    or its rows x its longest row (padded rows). Rows are rounded up to the sequence pad
    multiple (``tp_size`` with sequence parallelism, ``16 x tp_size`` with fp8), so it must
    hold ``rollout.max_prompt_length + rollout.max_response_length`` rounded up to it."""
    pack_sequences: bool = True
    """Pack several sequences (prompt + response) into one row of up to
    ``micro_batch_max_tokens`` tokens, each attending only to itself and its positions
    restarting at 0 (megatron's THD format: its local attention run per sequence on the
    CPU, Transformer Engine's THD attention on a GPU), for both the log-prob pass and the
    updates; false: one sequence per row, rows padded to the longest. The log-probs and
    gradients are the same either way (within float rounding); packing removes most of
    the padding the actor computes
    (``actor/padding_share`` beside ``actor/padding_share_unpacked``)."""
    lr: float = 1e-6
    """Peak learning rate of Adam."""
    lr_warmup_steps: int = 20
    """Linear warm-up of the learning rate, in rollout steps; constant afterwards."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    val_every: int = 5
    """Run validation every this many steps; 0 disables it."""
    val_before_train: bool = True
    """Validate the initial policy (logged as step 0) before the first step, and again
    after the last step, when ``data.val_files`` are set."""
    async_generation: bool = False
    """One-step-off-policy training: while the actor trains on step k's batch, the
    engines already generate step k+1's with the weights from before step k's update
    (every batch at most one update stale; the rollout correction defaults to TIS). Needs
    engines apart from the actor: their own GPUs (``rollout.colocate=false``), or on the
    CPU their own cores (ranks and engines are pinned to separate cores when the machine
    has enough)."""
    output_dir: str = "runs/dapo"
    """Run folder: the resolved config, logs and (by default) checkpoints go here."""
    stop_grace_s: float = 240.0
    """After SIGTERM or SIGUSR1 (a SLURM preemption or time limit): the seconds the run
    has to stop with a checkpoint. Generation in flight is abandoned at once, the actor's
    work in flight (log-probs, updates) finishes and the last completed step is saved;
    past this bound the run stops without that save (exit 75, the previous checkpoint
    stays the latest) so that the job is requeued before SLURM kills it. Keep it below
    the job's ``--signal`` lead time (``plan --signal-lead-s`` checks both)."""
    max_bad_steps_in_a_row: int = 3
    """A step with a NaN or infinite loss or gradient skips those updates (no weight
    changes) and is logged; this many such steps in a row stop the run with the step and
    the metrics that went bad. 0 never stops."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    tensorboard: bool = True
    """Write metrics to TensorBoard under ``<output_dir>/tensorboard``."""
    log_every: int = 1
    """Print metrics to the console every this many steps."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Console log level."""


@dataclass
class CheckpointConfig:
    """Megatron dist checkpoints of model, optimizer, scheduler, RNG and step."""

    save_every: int = 20
    """Save every this many steps; 0 disables saving."""
    save_dir: Optional[str] = None
    """Checkpoint folder; defaults to ``<output_dir>/checkpoints``."""
    load_dir: Optional[str] = None
    """Resume from the latest checkpoint here (any tp/pp layout)."""
    keep_last: int = 3
    """Number of checkpoints to keep; older ones are deleted after a successful save
    (0 keeps every one)."""
    export_hf: bool = True
    """At the end of a run, write the final policy as an HF checkpoint to
    ``<output_dir>/hf_final`` through the converter (verified as ``convert`` verifies; a
    final checkpoint is saved first if none was). ``dapo-megatron convert megatron-to-hf``
    exports any other checkpoint on request."""


@dataclass
class RayConfig:
    """Where the run's processes are placed."""

    address: Optional[str] = None
    """Ray cluster to join (``head:6379``; ``train.sbatch`` passes the head it started).
    Unset: a private local Ray instance is started inside the run folder and stopped at
    the end."""
    num_cpus: Optional[int] = None
    """Logical CPUs of a local instance; default: one per actor rank and engine, at least
    the machine's cores."""
    engine_num_threads: int = 0
    """Threads of each CPU rollout engine's torch ops; 0 = the machine's cores divided
    among the engines."""
    separate_cores: Optional[bool] = None
    """CPU runtime on one machine: pin each actor rank to a core of its own and the
    engines to the remaining cores (unset: on with ``trainer.async_generation``, where
    engines generate while the ranks train)."""


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The actor's device layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The DAPO objective."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batch sizes."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Training loop and optimizer."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Process placement (Ray)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, as it would be written in YAML."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The resolved config as YAML, loadable again by :func:`load_config`."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------- loading

PATH_KEYS = (
    "model.hf_config",
    "model.hf_weights",
    "data.train_files",
    "data.val_files",
    "data.tokenizer",
    "trainer.output_dir",
    "checkpoint.save_dir",
    "checkpoint.load_dir",
)
"""Keys that hold file or folder paths. A relative path written in a YAML file means a
path next to that file, wherever the command runs (a config and its data can be moved
together); one given on the command line means one in the current directory. Both are
stored absolute, so the resolved config written into the run folder loads anywhere, and
errors show the path that was actually looked at. Paths left at their defaults (and
those of a config built from a dict) are relative to the current directory."""


def _absolute(value: Any, base: Path) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_absolute(item, base) for item in value]
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path).resolve())


def _resolve_paths(config: Config, sources: dict[str, str], file_source: str, file_dir: Optional[Path]) -> None:
    """Make every path absolute: set in the file against ``file_dir``, else against the cwd."""
    for dotted in PATH_KEYS:
        from_file = sources.get(dotted) == file_source and file_dir is not None
        base = file_dir if from_file else Path.cwd()
        section, key = dotted.split(".")
        holder = getattr(config, section)
        setattr(holder, key, _absolute(getattr(holder, key), base))


def load_config(path: Optional[str | os.PathLike], overrides: Optional[list[str]] = None) -> Config:
    """Load, override, resolve and validate a config.

    Args:
        path: a YAML file; ``None`` starts from the defaults.
        overrides: ``section.key=value`` strings applied on top of the file.

    Raises:
        ConfigError: anything wrong, with source, key, value and rule in the message.
    """
    source = str(path) if path is not None else "defaults"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config file: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections "
                f"({', '.join(f.name for f in dataclasses.fields(Config))}), "
                f"found {type(loaded).__name__}"
            )
        raw = loaded
    folder = Path(path).resolve().parent if path is not None else None
    return config_from_dict(raw, source, overrides, base_dir=folder)


def config_from_dict(
    raw: dict[str, Any],
    source: str = "<dict>",
    overrides: Optional[list[str]] = None,
    *,
    base_dir: Optional[Path] = None,
) -> Config:
    """Build, override, resolve and validate a config from a nested dict (as parsed from YAML).

    ``base_dir``: the folder relative paths in ``raw`` are relative to (the YAML file's);
    without it they stay as written. Paths in ``overrides`` are resolved against the
    current directory (see :data:`PATH_KEYS`).
    """
    sources: dict[str, str] = {}
    config = build_dataclass(Config, raw, "", source, sources)
    for override in overrides or []:
        apply_override(config, override)
        sources[override.split("=", 1)[0].strip()] = COMMAND_LINE
    _resolve_paths(config, sources, source, base_dir)
    resolve_model_shape(config.model, _Where(sources, source))
    validate(config, sources=sources, default_source=source)
    config._where = _Where(sources, source)  # not a field: never written to YAML
    return config


def source_of(config: Config, *keys: str) -> str:
    """Where the values of ``keys`` came from (the file, the command line, or both), for
    messages about a loaded config; ``"config"`` for one not built by :func:`load_config`."""
    where = getattr(config, "_where", None)
    return where(*keys) if where is not None else "config"


# --------------------------------------------------------------------------- model shape


class _Where:
    """Tells where the values of some dotted keys came from: the file, the command line, or
    both. Keys left at their defaults or read from the model's ``config.json`` (which the
    user does not edit) count as the default source, the config file."""

    def __init__(self, sources: dict[str, str], default: str) -> None:
        self.sources = sources
        self.default = default

    def __call__(self, *keys: str) -> str:
        """One source by name; several, each with its keys: ``command line (a.b) and run.yaml (c.d)``."""
        by_source: dict[str, list[str]] = {}
        for key in keys:
            if key in self.sources:
                by_source.setdefault(self.sources[key], []).append(key)
        if len(by_source) <= 1:
            return next(iter(by_source), self.default)
        return " and ".join(f"{source} ({', '.join(names)})" for source, names in by_source.items())


def hf_model_folder(hf_config: Optional[str | os.PathLike]) -> Optional[Path]:
    """The folder ``model.hf_config`` names (it may name the folder or its config.json)."""
    if hf_config is None:
        return None
    path = Path(hf_config)
    return path if path.is_dir() else path.parent


def checkpoint_save_dir(config: Config) -> Path:
    """Where the run's checkpoints go: ``checkpoint.save_dir``, else ``<output_dir>/checkpoints``."""
    return Path(config.checkpoint.save_dir or Path(config.trainer.output_dir) / "checkpoints")


GENERATE_FLOOR_S = 600.0
"""The derived generation bound's fixed part (an engine's queue, prefill, a slow start)."""
SLOWEST_ROW_TOKENS_PER_S = 5.0
"""The derived generation bound's decode rate per response row: several times below any
engine's on the hardware it serves (a 32B model on SGLang decodes 20-40 tokens/s a row)."""
SYNC_CALL_FLOOR_S = 120.0
"""The derived weight-sync bound's fixed part (opening or closing an engine's session)."""
SLOWEST_SYNC_MB_PER_S = 10.0
"""The derived weight-sync bound's copy rate, far below any link's (CUDA IPC, NCCL, gloo)."""


def generate_bound_s(rollout: RolloutConfig) -> float:
    """``rollout.generate_timeout_s``, or the bound derived from the tokens a row generates."""
    if rollout.generate_timeout_s:
        return rollout.generate_timeout_s
    return GENERATE_FLOOR_S + rollout.max_response_length / SLOWEST_ROW_TOKENS_PER_S


def weight_sync_bound_s(rollout: RolloutConfig) -> float:
    """``rollout.weight_sync_timeout_s``, or the bound derived from a bucket's bytes."""
    if rollout.weight_sync_timeout_s:
        return rollout.weight_sync_timeout_s
    return SYNC_CALL_FLOOR_S + rollout.weight_sync_bucket_mb / SLOWEST_SYNC_MB_PER_S


def hf_weights_folder(model: ModelConfig) -> Optional[Path]:
    """The HF folder the run's initial weights and default tokenizer come from."""
    if model.hf_weights is not None:
        return Path(model.hf_weights)
    return hf_model_folder(model.hf_config)


# --------------------------------------------------------------------------- validation


def pipeline_layer_split(num_layers: int, parallel: ParallelConfig) -> list[int]:
    """Layers on each pipeline stage, or raise ValueError saying why the split is impossible."""
    pp = parallel.pp_size
    first = parallel.num_layers_in_first_pipeline_stage
    last = parallel.num_layers_in_last_pipeline_stage
    if pp == 1:
        return [num_layers]
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError("uneven split does not add up")
    if middle_stages and middle_layers % middle_stages:
        raise ValueError("uneven split does not add up")
    per_stage = middle_layers // middle_stages if middle_stages else 0
    split = [per_stage] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def validate(config: Config, *, sources: Optional[dict[str, str]] = None, default_source: str = "config") -> None:
    """Check the rules that span keys and sections; raise ConfigError on the first broken one."""
    where = _Where(sources or {}, default_source)

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
        *[n for n in _SHAPE_FIELDS if n not in ("family", "rms_norm_eps", "rope_theta", "tie_word_embeddings")],
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
    model_parallel = p.tp_size * p.pp_size * p.cp_size
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
        pipeline_layer_split(m.num_layers, p)
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
    stage_ranks = p.tp_size * p.cp_size * data_parallel_size(p)
    if stage_ranks % p.ep_size:
        valid = [e for e in _divisors(m.num_experts) if stage_ranks % e == 0]
        fail(
            ("parallel.ep_size", "parallel.tp_size", "parallel.dp_size", "parallel.num_devices_per_node"),
            f"parallel.ep_size={p.ep_size} must divide the ranks of a pipeline stage, "
            f"tp_size*cp_size*dp_size={p.tp_size}*{p.cp_size}*{data_parallel_size(p)}={stage_ranks}"
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


def carries_over(rollout: RolloutConfig) -> bool:
    """Whether streamed generation trains tokens of earlier policies: carried groups or
    partial responses (both need ``rollout.streaming``, which validation checks)."""
    return rollout.carry_over or rollout.partial_rollout


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
    if r.max_staleness != defaults.max_staleness and not carries_over(r):
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
    if r.max_staleness < 1 and carries_over(r):
        fail(
            ("rollout.max_staleness",),
            f"rollout.max_staleness={r.max_staleness} must be >= 1 with carry_over or partial_rollout (what is "
            "carried is trained at least one version later)",
        )


def rollout_correction_of(config: Config) -> str:
    """The correction in effect: ``algorithm.rollout_correction`` with ``auto`` resolved."""
    a = config.algorithm
    if a.rollout_correction != "auto":
        return a.rollout_correction
    off_policy = config.trainer.async_generation or carries_over(config.rollout)
    return "tis" if off_policy and not a.use_rollout_log_probs else "none"


def _validate_batches(config: Config, fail) -> None:
    """Batch sizes against each other, the layout and the sequence lengths; the optimizer."""
    p, r, a, d, t = config.parallel, config.rollout, config.algorithm, config.data, config.trainer
    model_parallel = p.tp_size * p.pp_size * p.cp_size
    num_responses = d.train_batch_size * r.n_samples_per_prompt
    dp_size = p.dp_size or p.world_size // model_parallel
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


def data_parallel_size(parallel: ParallelConfig) -> int:
    """The data-parallel size, explicit or derived from the world size."""
    return parallel.dp_size or parallel.world_size // (parallel.tp_size * parallel.pp_size * parallel.cp_size)
