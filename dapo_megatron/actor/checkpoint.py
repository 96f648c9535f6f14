"""Actor checkpoints in megatron's dist-checkpoint format, loadable at any TP/PP layout.

A checkpoint holds the model, the optimizer state (megatron's model-space sharding, so it
reshards across tensor/pipeline/data-parallel layouts), the LR scheduler, the RNG states
and the rollout step. It is written into ``step_NNNNNNNN.tmp`` and renamed to
``step_NNNNNNNN`` only after every rank has finished, and ``latest`` is replaced
atomically afterwards, so a crash mid-save never leaves a folder that looks complete and
never moves ``latest`` to a broken checkpoint; its files and folders are fsynced before
each rename, so that a power loss does not either. Old checkpoints beyond ``keep_last``
are deleted only after a save succeeded, never the one it published.

RNG states are per (pipeline, tensor) rank; they are restored only when the checkpoint
was written with the same layout (otherwise megatron's trackers are re-seeded from the
run's seed and the step, and a warning says so). The actor itself has no dropout, so
this affects nothing that the trainer computes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from dapo_megatron.ckpt.dcp_io import LATEST, latest_checkpoint
from dapo_megatron.ckpt.loading import load_megatron_weights

logger = logging.getLogger(__name__)

_STEP_PREFIX = "step_"


def checkpoint_dir(save_dir: str | os.PathLike, step: int) -> Path:
    """Folder of the checkpoint of rollout step ``step``."""
    return Path(save_dir) / f"{_STEP_PREFIX}{step:08d}"


def list_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """The published checkpoint folders of ``save_dir`` (``step_*``, not the ``.tmp``
    folders of unfinished saves), oldest first."""
    return sorted(p for p in Path(save_dir).glob(f"{_STEP_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_checkpoint(staging: Path, final: Path) -> None:
    """Rename the written checkpoint ``staging`` to ``final``, after its files and folders
    are on the disk: a power loss after the rename never leaves a ``final`` (or a
    ``latest`` naming it) with files that were still in the page cache."""
    for folder, _, files in os.walk(staging):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))
    staging.rename(final)
    _fsync(final.parent)


def point_latest_at(save_dir: str | os.PathLike, checkpoint: Path, step: int) -> None:
    """Make ``latest`` name ``checkpoint`` (of ``step``), atomically and durably, as a save does."""
    staged = Path(save_dir) / (LATEST + ".tmp")
    with open(staged, "w") as f:
        f.write(json.dumps({"step": step, "path": checkpoint.name}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    staged.replace(Path(save_dir) / LATEST)
    _fsync(Path(save_dir))


def prune_checkpoints(save_dir: str | os.PathLike, final: Path, keep_last: int) -> None:
    """Delete the checkpoints older than ``final`` (just published) beyond the newest
    ``keep_last`` (``final`` included; 0 keeps every one). ``final`` is never deleted,
    and nor is a later checkpoint (one a ``--resume-from`` run has not reached again)."""
    if keep_last <= 0:
        return
    older = [p for p in list_checkpoints(save_dir) if p.name < final.name]
    for old in older[: max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(old)


def _layout(actor) -> dict:
    return {"tp_size": actor.parallel.tp_size, "pp_size": actor.parallel.pp_size, "ep_size": actor.parallel.ep_size}


def _sharded_state_dict(actor, is_loading: bool) -> dict:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_state = actor.gpt.sharded_state_dict(prefix="")
    rng = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if actor.device.type == "cuda" else None,
        "tracker": _tracker_states(),
    }
    pp_rank, tp_rank = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    return {
        "model": model_state,
        # 'fully_reshardable': optimizer state in the canonical per-parameter layout, so
        # it loads at another tp/pp/dp layout. Its memory-efficient exchange (megatron-core
        # 0.16.1, distrib_optimizer.py: sharded_param_state_fully_reshardable) gathers each
        # bucket's shards over gloo into host memory of data-parallel rank 0 only; the
        # default all-gathers them over NCCL into GPU buffers and then holds the whole
        # stage's fp32 state in host memory on every rank.
        "optimizer": actor.optimizer.sharded_state_dict(
            model_state,
            is_loading=is_loading,
            metadata={
                "distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": True,
                # Experts have an optimizer of their own at ep > 1 only (megatron's
                # chained optimizer); without a "chained_<i>." prefix the state keys are
                # the parameters' at every ep size, so a checkpoint moves between them.
                "chained_optim_avoid_prefix": True,
            },
        ),
        "rng_state": ShardedObject(
            "rng_state",
            rng,
            (actor.parallel.pp_size, actor.parallel.tp_size),
            (pp_rank, tp_rank),
            replica_id=parallel_state.get_data_parallel_rank(),
        ),
    }


def _torch_adams(optimizer) -> list:
    """The chained optimizers whose inner optimizer is torch's own Adam/AdamW (the CPU
    runtime's, without Apex/TE). The three workarounds below are for its per-parameter
    ``step`` and apply to it only: Transformer Engine's FusedAdam keeps the step in the
    param group, and a per-parameter ``step`` put into its state makes its
    ``state_dict`` raise ``KeyError('step')``."""
    return [
        chained
        for chained in getattr(optimizer, "chained_optimizers", [optimizer])
        if type(chained.optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    ]


def _materialize_optimizer_state(optimizer) -> None:
    """Give a never-stepped torch Adam zero moments and step 0, in place.

    Loading a dist checkpoint fills existing optimizer state in place, and megatron's
    distributed optimizer (with torch's Adam, no Apex/TE) reads the step from that state;
    a freshly built optimizer has none yet. Nothing here touches a parameter.
    """
    for chained in _torch_adams(optimizer):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


@contextlib.contextmanager
def _torch_adam_step_passthrough(optimizer):
    """Work around megatron-core 0.16's 'fully_reshardable' load with torch's Adam.

    Its loader restores Adam's ``step`` from the param groups and leaves it out of each
    parameter's tensors on purpose, but the copy that follows iterates the destination's
    keys, ``step`` included, and fails with ``KeyError: 'step'`` (Apex/TE's FusedAdam has
    no per-parameter step, so GPU runs never hit it). While loading, each parameter's
    current (already restored) step is handed back to that copy, which makes it a no-op.
    """
    patched = []
    for chained in _torch_adams(optimizer):
        original = getattr(chained, "_set_main_param_and_optimizer_states", None)
        if original is None or chained.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue

        def with_step(model_param, tensors, _original=original, _chained=chained):
            group_index, group_order = _chained.model_param_group_index_map[model_param]
            main_param = _chained.optimizer.param_groups[group_index]["params"][group_order]
            step = _chained.optimizer.state[main_param].get("step")
            if step is not None and "step" not in tensors:
                tensors = {**tensors, "step": step.clone()}
            return _original(model_param, tensors)

        chained._set_main_param_and_optimizer_states = with_step
        patched.append(chained)
    try:
        yield
    finally:
        for chained in patched:
            del chained._set_main_param_and_optimizer_states


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor again.

    megatron-core 0.16 restores torch Adam's step as one tensor object shared by every
    parameter's state; torch's Adam increments each parameter's step in place, so a
    shared one advances once per parameter per update and the bias correction after a
    resume is wrong. (Apex/TE FusedAdam keeps the step in the param group: not affected.)
    """
    for chained in _torch_adams(optimizer):
        for state in chained.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _tracker_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def save_dist_checkpoint(sharded_state_dict: dict, folder: str | os.PathLike) -> None:
    """``megatron.core.dist_checkpointing.save`` of ``sharded_state_dict`` into the existing
    empty ``folder``, synchronously (every file written when it returns).

    megatron's writer hands the writes' results back through a queue that, on a process's
    first save, it creates as a ``multiprocessing`` Manager's: a spawned interpreter, for an
    asynchronous save's background process to reach. It took 1.6 s of a first save whose
    later ones took 0.06 s (the tests' tiny model, one gloo rank on a 2-core VM). A
    synchronous save puts and takes the results in this process, so while no queue exists
    yet, a plain one is set in its place (an asynchronous save would need megatron's own;
    none is made here). Where megatron no longer has that queue, nothing is changed.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(folder))


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one stays the latest."""


def save_checkpoint(
    actor,
    save_dir: str | os.PathLike,
    keep_last: int = 0,
    extra_files: Optional[dict[str, str]] = None,
    moved_files: Optional[dict[str, str]] = None,
) -> Path:
    """Save the actor at its current rollout step; returns the checkpoint folder.

    All ranks of the actor must call it. ``keep_last > 0`` deletes older checkpoints
    beyond that many after the save succeeded. ``extra_files`` (name -> text, e.g. the
    trainer's own state) are written into the checkpoint before it is published, so a
    checkpoint that ``latest`` names always has them; ``moved_files`` (name -> path of a
    file the caller wrote on the checkpoint's file system, e.g. the batch generated ahead)
    are moved in by rank 0 at the same moment (only their path travels to the ranks).
    """

    final = checkpoint_dir(save_dir, actor.rollout_step)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state_dict(actor, is_loading=False)
    state["scheduler"] = actor.scheduler.state_dict()
    state["rollout_step"] = actor.rollout_step
    state["layout"] = _layout(actor)
    error: Optional[BaseException] = None
    try:
        save_dist_checkpoint(state, staging)
    except BaseException as exc:  # a failing write (disk full, ...): every rank learns of it below
        # torch's CheckpointException, which gathers every rank's write errors, is a
        # BaseException; interruptions are not write failures.
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = exc
    written = torch.tensor([0.0 if error else 1.0], device=actor.device)
    dist.all_reduce(written, op=dist.ReduceOp.MIN)
    if written.item() < 1.0:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        previous = latest_checkpoint(save_dir)
        kept = f"the latest checkpoint is still {previous}" if previous else "no earlier checkpoint exists"
        why = f"{type(error).__name__}: {error}" if error else "a write failed on another rank"
        raise CheckpointWriteError(
            f"writing the checkpoint of step {actor.rollout_step} to {staging} failed ({why}); nothing of it was "
            f"kept and {kept}"
        ) from error
    if rank == 0:
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        for name, source in (moved_files or {}).items():
            shutil.move(source, staging / name)
        if final.exists():  # this run's own, from before a --resume-from (the trainer refuses another run's)
            shutil.rmtree(final)
        publish_checkpoint(staging, final)
        point_latest_at(save_dir, final, actor.rollout_step)
        prune_checkpoints(save_dir, final, keep_last)
    dist.barrier()
    logger.info("saved checkpoint of step %d to %s", actor.rollout_step, final)
    return final


def load_checkpoint(actor, load_dir: str | os.PathLike, *, seed: int = 0) -> int:
    """Restore model, optimizer, scheduler, step (and RNG when the layout matches).

    Returns the restored rollout step. Raises FileNotFoundError when ``load_dir`` holds no
    checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    path = latest_checkpoint(load_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (no '{LATEST}' file and no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    same_layout = common.get("layout") == _layout(actor)
    _materialize_optimizer_state(actor.optimizer)
    state = _sharded_state_dict(actor, is_loading=True)
    if not same_layout:
        del state["rng_state"]
    loaded = dist_checkpointing.load(state, str(path))
    actor.gpt.load_state_dict(loaded["model"])
    with _torch_adam_step_passthrough(actor.optimizer):
        actor.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(actor.optimizer)
    actor.scheduler.load_state_dict(loaded["scheduler"])
    actor.rollout_step = int(loaded["rollout_step"])
    if same_layout:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and actor.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    else:
        logger.warning(
            "checkpoint %s was written at layout %s, loading at %s: RNG states re-seeded instead of restored",
            path,
            common.get("layout"),
            _layout(actor),
        )
        torch.manual_seed(seed + actor.rollout_step)
        model_parallel_cuda_manual_seed(seed + actor.rollout_step, force_reset_rng=True)
    return actor.rollout_step


def load_model_weights(actor, path: str | os.PathLike) -> None:
    """Load only the model weights from a dist checkpoint (e.g. a converted HF model)."""
    load_megatron_weights(actor.gpt, latest_checkpoint(path) or path)
    # The optimizer keeps fp32 main copies of bf16 weights: refresh them from the model.
    actor.optimizer.reload_model_params()


def _tp_and_ep(actor) -> tuple[int, int, int, int]:
    """This rank's tensor- and expert-parallel rank and sizes, as ``load_hf_weights`` takes them."""
    runtime, parallel = actor.runtime, actor.parallel
    return runtime.tp_rank, parallel.tp_size, runtime.ep_rank, parallel.ep_size


def load_hf_model_weights(actor, hf_dir: str | os.PathLike) -> None:
    """Load only the model weights straight from an HF safetensors folder (converted on load)."""
    from dapo_megatron.ckpt.loading import load_hf_weights
    from dapo_megatron.ckpt.mapping import ModelShape

    shape = ModelShape.from_model_config(actor.model_config)
    load_hf_weights(actor.gpt, hf_dir, shape, *_tp_and_ep(actor))
    actor.optimizer.reload_model_params()


def load_reference_weights(actor, source: str, path: str | os.PathLike) -> None:
    """The KL penalty's reference policy (``actor.reference``) from ``source``: ``megatron``
    (a dist checkpoint's model weights) or ``hf`` (safetensors, converted on load). The
    trainer gives it the run's initial weights, also on resume (checkpoints do not hold it)."""
    if actor.reference is None:
        raise ValueError("the actor holds no reference policy (algorithm.use_kl_loss is off)")
    if source == "megatron":
        load_megatron_weights(actor.reference, latest_checkpoint(path) or path)
    elif source == "hf":
        from dapo_megatron.ckpt.loading import load_hf_weights
        from dapo_megatron.ckpt.mapping import ModelShape

        shape = ModelShape.from_model_config(actor.model_config)
        load_hf_weights(actor.reference, path, shape, *_tp_and_ep(actor))
    else:
        raise ValueError(f"unknown weight source {source!r}")
