"""The run's configuration sections: one torch-free dataclass per component, each field
with its type, its default and a docstring (``docs/configuration.md`` is generated from
them), and the facts derived from the settings (where checkpoints go, the derived time
bounds, the rollout correction in effect).

Loading lives in :mod:`dapo_megatron.config.loading`, the rules that span keys in
:mod:`dapo_megatron.config.validate`, the model section in :mod:`dapo_megatron.config.model`
and the parallel layout's arithmetic in :mod:`dapo_megatron.config.layout`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from dapo_megatron.config.model import ModelConfig


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

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: ``tp_size x pp_size x cp_size``."""
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel size: ``dp_size``, or derived from the world size."""
        return self.dp_size or self.world_size // self.model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: a stage's tp x cp x dp ranks over ``ep_size``
        (expert-tensor-parallel size 1)."""
        return self.tp_size * self.cp_size * self.data_parallel_size // self.ep_size

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers on each pipeline stage (``num_layers_in_first/last_pipeline_stage``, the
        rest split evenly), or ValueError saying why the split is impossible."""
        pp, first, last = self.pp_size, self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if pp == 1:
            return [num_layers]
        middle_layers = num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
            raise ValueError("uneven split does not add up")
        if middle_stages and middle_layers % middle_stages:
            raise ValueError("uneven split does not add up")
        split = [middle_layers // middle_stages if middle_stages else 0] * pp
        if first is not None:
            split[0] = first
        if last is not None:
            split[-1] = last
        return split


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
    env: Optional[str] = None
    """Multi-turn, tool-using rollouts: the environment each response is an episode of (a
    registered name, ``calculator``, or ``module:Class``; docs/environments.md). The
    model's turns and the environment's observations make one token sequence after the
    prompt, the model's tokens as the engine sampled them; only those are trained, and
    ``max_response_length`` bounds all of them. Unset: single-turn responses."""
    env_options: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Multi-turn (``env``): keyword arguments of the environment's class, checked by the
    run's pre-flight (``python``: ``timeout_s``, ``memory_mb``, ``output_chars``,
    ``file_mb``, ``workers``; docs/environments.md)."""
    observation_format: Literal["inline", "chat"] = "inline"
    """Multi-turn (``env``): ``inline``, an observation's text right after the model's turn,
    as the environment wrote it (a tool's output inside the assistant's message, as ReTool
    trains); ``chat``, the turn closed as an assistant message and the observation a
    ``tool`` message of the tokenizer's chat template, the next assistant message opened
    after it (docs/environments.md). Either way tokenised once, out of the loss."""
    max_turns: int = 8
    """Multi-turn (``env``): the most model turns of an episode; one that reaches it ends
    there, counted in ``episode/ended_by_max_turns``."""
    val_n_samples: int = 32
    """Responses per validation prompt (avg@32 for AIME)."""
    val_temperature: float = 1.0
    """Sampling temperature for validation."""
    val_top_p: float = 0.7
    """Nucleus sampling threshold for validation."""

    @property
    def carries_over(self) -> bool:
        """Whether streamed generation trains tokens of earlier policies: carried groups or
        partial responses (both need ``streaming``, which validation checks)."""
        return self.carry_over or self.partial_rollout

    @property
    def generate_bound_s(self) -> float:
        """``generate_timeout_s``, or the bound derived from the tokens a row generates."""
        if self.generate_timeout_s:
            return self.generate_timeout_s
        return GENERATE_FLOOR_S + self.max_response_length / SLOWEST_ROW_TOKENS_PER_S

    @property
    def weight_sync_bound_s(self) -> float:
        """``weight_sync_timeout_s``, or the bound derived from a bucket's bytes."""
        if self.weight_sync_timeout_s:
            return self.weight_sync_timeout_s
        return SYNC_CALL_FLOOR_S + self.weight_sync_bucket_mb / SLOWEST_SYNC_MB_PER_S


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
    system_prompt: Optional[str] = None
    """A system message put before every prompt's messages, training and validation (a
    row whose first message is a system message keeps its own): the instructions of a
    tool-using recipe, say. Unset: the rows as they are."""
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
    rollout_records_every: int = 1
    """Write every this many steps' rollouts to ``<output_dir>/rollouts/step_NNNNNN.jsonl.gz``
    (prompt, response, reward and its parts, advantage, kept or why dropped, both
    log-probs; docs/running.md), and every validation's; 0: none."""
    wandb: bool = False
    """Also log to Weights & Biases (the ``wandb`` extra: ``pip install -e .[wandb]``):
    the same metrics under the same names, and a table of sampled responses every
    ``wandb_table_every`` steps; a resumed run continues the same W&B run (its id is kept
    in ``<output_dir>/wandb_run_id``)."""
    wandb_project: str = "dapo-megatron"
    """W&B project."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); unset: the account's default."""
    wandb_name: Optional[str] = None
    """W&B run name; unset: the run folder's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``offline``: W&B writes the run under ``<output_dir>/wandb`` only, for ``wandb sync``
    later (no network)."""
    wandb_table_every: int = 10
    """Log a table of a step's sampled responses (8 groups) every this many steps; 0: none."""
    rollout_records_groups: int = 16
    """The groups of a step written (a seeded draw among those kept and dropped); 0: all.
    Bounds a step's file at scale (the 32B recipe: 16 groups of 16 responses, about 8 MB
    of JSON, 2-3 MB gzip'd; docs/running.md)."""


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

    @property
    def checkpoint_save_dir(self) -> Path:
        """Where the run's checkpoints go: ``checkpoint.save_dir``, else ``<output_dir>/checkpoints``."""
        return Path(self.checkpoint.save_dir or Path(self.trainer.output_dir) / "checkpoints")

    @property
    def rollout_correction_in_effect(self) -> str:
        """``algorithm.rollout_correction`` with ``auto`` resolved: token TIS when the run
        trains off-policy tokens (async generation, carried groups or partial responses)
        on the actor's old log-probs, else none."""
        a = self.algorithm
        if a.rollout_correction != "auto":
            return a.rollout_correction
        off_policy = self.trainer.async_generation or self.rollout.carries_over
        return "tis" if off_policy and not a.use_rollout_log_probs else "none"


GENERATE_FLOOR_S = 600.0
"""The derived generation bound's fixed part (an engine's queue, prefill, a slow start)."""


SLOWEST_ROW_TOKENS_PER_S = 5.0
"""The derived generation bound's decode rate per response row: several times below any
engine's on the hardware it serves (a 32B model on SGLang decodes 20-40 tokens/s a row)."""


SYNC_CALL_FLOOR_S = 120.0
"""The derived weight-sync bound's fixed part (opening or closing an engine's session)."""


SLOWEST_SYNC_MB_PER_S = 10.0
"""The derived weight-sync bound's copy rate, far below any link's (CUDA IPC, NCCL, gloo)."""
