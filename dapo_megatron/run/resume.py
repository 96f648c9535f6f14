"""A run's checkpoints and everything a resumed run needs: :class:`RunCheckpoint`.

A checkpoint is the actor's (megatron's dist checkpoint, any tp/pp layout) with the run's
own state inside it, written before it is published: the trainer state (the step, the
data position, the settings that position depends on), and when there is one the batch
generated ahead (async generation) and the sampler's state (streamed generation: the
groups carried over, the partial responses). :meth:`RunCheckpoint.save` writes them all,
:meth:`RunCheckpoint.restore` reads them all back, so the continued run takes the same
steps an uninterrupted one would.

Before anything starts, a run refuses a checkpoint folder that holds another run's
checkpoints, a damaged checkpoint (naming the previous complete one) and data or
settings that no longer match the saved position. A run folder whose earlier attempt
left no checkpoint is reused, its files set aside when the run starts.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.actor.checkpoint import checkpoint_dir, list_checkpoints, point_latest_at
from dapo_megatron.ckpt.dcp_io import LATEST, checkpoint_problem, latest_checkpoint
from dapo_megatron.config import Config, ConfigError, source_of
from dapo_megatron.run.system import load_initial_weights
from dapo_megatron.sampling.samples import load_samples, save_samples

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
"""The trainer's own state, inside each actor checkpoint (written before it is published)."""


STREAM_STATE = "stream_state.pt"
"""Streamed generation: the groups carried over and the partial responses in flight, in
each checkpoint of a run that streams (see :class:`dapo_megatron.sampling.streaming.StreamingSampler`)."""


GENERATED_AHEAD = "generated_ahead.pt"
"""Async generation: the next step's batch, in each checkpoint that has one (binary,
written once by the driver; see :func:`dapo_megatron.sampling.samples.save_samples`)."""


RESUME_KEYS = (
    "data.seed",
    "data.shuffle",
    "data.train_batch_size",
    "data.gen_batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.streaming",
    "rollout.carry_over",
    "rollout.partial_rollout",
    "rollout.max_prompts_in_flight",
    "rollout.stream_chunk_tokens",
    "rollout.max_staleness",
)
"""Settings the saved data position and batches depend on: a resume must keep them."""


def _setting(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _trainer_state(
    step: int, data: dict, config: Config, num_prompts: int, ahead: Optional[str], stream: Optional[str]
) -> str:
    """What a resumed run needs besides the actor: the step, the data position, what the
    rollout seeds derive from and the settings the data position depends on, and (async
    generation) the name of the file that holds the next step's batch, generated during
    this one with weights the checkpoint no longer holds, and (streamed generation) of the
    file that holds the groups carried over and the partial responses in flight.
    Generation seeds are a function of (rollout.seed, step, round, prompt, sample), and
    otherwise dynamic sampling drops its surplus at the end of every step, so no sampler
    state or other leftover samples need saving."""
    return json.dumps(
        {
            "step": step,
            "data": data,
            "num_prompts": num_prompts,
            "rollout_seed": config.rollout.seed,
            "settings": {key: _setting(config, key) for key in RESUME_KEYS},
            "metrics_step": step,
            "generated_ahead": ahead,
            "stream_state": stream,
        },
        indent=1,
    )


def _read_trainer_state(path: Path) -> dict:
    """The trainer state inside checkpoint ``path``; a missing or damaged file is refused,
    naming it (and the previous complete checkpoint of its folder, when there is one)."""
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise ConfigError(
            f"{path} has no {TRAINER_STATE}: it was not written by `dapo-megatron train`, so there is no data "
            f"position to resume; to start a new run from its weights, set checkpoint.load_dir={path} without --resume"
        )
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step in it")
    except ValueError as exc:  # JSONDecodeError included
        raise ConfigError(f"{state_file} is damaged ({exc}){_previous_complete(path.parent, path)}") from None
    return state


def _checked(path: Path) -> tuple[Path, dict]:
    """``(path, trainer state)`` of a checkpoint whose files are all there in full."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"cannot resume from {path}: {problem}{_previous_complete(path.parent, path)}")
    return path, _read_trainer_state(path)


def _previous_complete(save_dir: Path, damaged: Optional[Path]) -> str:
    """``"; the previous complete checkpoint is ..."``: the newest checkpoint of ``save_dir``
    other than ``damaged`` whose files and trainer state are whole, and how to continue."""
    for candidate in reversed(list_checkpoints(save_dir)):
        if damaged is not None and candidate.resolve() == damaged.resolve():
            continue
        if checkpoint_problem(candidate) is not None:
            continue
        try:
            step = json.loads((candidate / TRAINER_STATE).read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return (
            f"; the previous complete checkpoint is {candidate} (step {step}): continue from it with "
            f"`--resume-from {candidate}` (the damaged one is kept, moved aside)"
        )
    return f"; {save_dir} holds no other complete checkpoint"


def _resume_point(config: Config, save_dir: str, explicit: Optional[str | Path] = None) -> tuple[Path, dict]:
    """The checkpoint to resume from and its trainer state: ``explicit`` when given, else
    the latest complete checkpoint of the run's checkpoint folder, else of
    ``checkpoint.load_dir``. A damaged one is refused naming the bad file and offering
    the previous complete checkpoint."""
    if explicit is not None:
        if not Path(explicit).is_dir():
            raise ConfigError(f"--resume-from {explicit}: no such checkpoint folder")
        return _checked(Path(explicit))
    sources = [("the run's checkpoint folder", save_dir)]
    if config.checkpoint.load_dir:
        sources.append(("checkpoint.load_dir", config.checkpoint.load_dir))
    path = None
    for key, source in sources:
        try:
            path = latest_checkpoint(source)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"cannot resume from {key} {source}: {exc}{_previous_complete(Path(source), None)}"
            ) from None
        if path is not None:
            break
    if path is None:
        where = " or ".join(f"{key} {source}" for key, source in sources)
        raise ConfigError(
            f"nothing to resume: no checkpoint in {where}; start the run without --resume (a run folder "
            "without checkpoints is reused, its earlier files kept aside)"
        )
    return _checked(path)


def _refuse_a_save_dir_with_checkpoints(config: Config, save_dir: str) -> None:
    """A run started without resume writes its checkpoints from step 1 on: into a folder
    that holds checkpoints (another run's, or this run's from an earlier attempt) it
    would replace theirs of the same steps and move ``latest`` backwards. Refused, naming
    the folder, before anything is touched."""
    found = [p.name for p in list_checkpoints(save_dir)]
    if (Path(save_dir) / LATEST).exists():
        found.append(LATEST)
    if not found:
        return
    key = "checkpoint.save_dir" if config.checkpoint.save_dir else "trainer.output_dir (its checkpoints/ folder)"
    shown = ", ".join(found if len(found) <= 4 else [found[0], "...", *found[-2:]])
    raise ConfigError(
        f"{source_of(config, key.split()[0])}: {key}: {save_dir} already holds checkpoints ({shown}); a run "
        "started without --resume would overwrite them. Pass --resume to continue the run they belong to, or "
        "choose another checkpoint.save_dir (nothing in it was touched)"
    )


def _earlier_attempt(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds an earlier attempt (its save folder holds no checkpoint:
    see :func:`_refuse_a_save_dir_with_checkpoints`); it is reused, its files set aside
    when the run starts."""
    earlier = run_dir / "metrics.jsonl"
    return earlier.exists() and earlier.stat().st_size > 0


EARLIER_ATTEMPT_FILES = ("metrics.jsonl", "tensorboard", "config.yaml")
"""What an earlier attempt without checkpoints leaves in a run folder, set aside on reuse."""


def _set_earlier_attempt_aside(run_dir: Path) -> None:
    aside = run_dir / f"earlier-attempt-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for name in EARLIER_ATTEMPT_FILES:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(aside / name))
    logger.warning(
        "%s held an earlier attempt that stopped before its first checkpoint; its files are in %s, and the run "
        "starts again from step 0",
        run_dir,
        aside,
    )


def _supersede_later_checkpoints(save_dir: str, resumed: Path, step: int) -> None:
    """After ``--resume-from`` an earlier checkpoint of the run: the later ones (and the
    damaged one) are moved into ``superseded-<time>/`` of the save folder (kept, and out
    of ``keep_last``'s count), and ``latest`` names the resumed one."""
    later = [p for p in list_checkpoints(save_dir) if p.name > checkpoint_dir(save_dir, step).name]
    if later:
        aside = Path(save_dir) / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for folder in later:
            shutil.move(str(folder), str(aside / folder.name))
        logger.warning(
            "resumed from step %d: the later checkpoints %s were moved to %s", step, [p.name for p in later], aside
        )
    if Path(save_dir).resolve() == resumed.parent.resolve():
        point_latest_at(save_dir, resumed, step)


def _check_resumable(resume_from: tuple[Path, dict], config: Config, num_prompts: int) -> None:
    """Refuse a resume whose data no longer matches the saved position; warn when the
    rollout seed changed (the run continues, but not as the uninterrupted one would)."""
    path, state = resume_from
    if state["num_prompts"] != num_prompts:
        raise ConfigError(
            f"{path}: the run was saved with {state['num_prompts']} training prompts but data.train_files now hold "
            f"{num_prompts}; its data position would be meaningless. Resume with the same data.train_files"
        )
    changed = [
        f"{key}={_setting(config, key)!r} (saved with {saved!r})"
        for key, saved in state.get("settings", {}).items()
        if _setting(config, key) != saved
    ]
    if changed:
        raise ConfigError(
            f"{path}: " + ", ".join(changed) + ": the saved data position and batches depend on these settings, so "
            "the resumed run would not continue the saved one; resume with the saved values (or start a new run "
            "from this checkpoint's weights with checkpoint.load_dir and without --resume)"
        )
    if state["rollout_seed"] != config.rollout.seed:
        logger.warning(
            "rollout.seed is %d, the run was saved with %d: the resumed steps sample differently from an "
            "uninterrupted run",
            config.rollout.seed,
            state["rollout_seed"],
        )


class RunCheckpoint:
    """The run's checkpoints (see the module docstring).

    ``resume``: continue from the latest complete checkpoint of the run's checkpoint
    folder, else of ``checkpoint.load_dir``; ``resume_from``: from that checkpoint (one
    before a damaged latest one; the later ones are moved aside when the run starts).
    Everything that can refuse the run does so here or in :meth:`check_data`, before
    any process starts and any file changes.
    """

    def __init__(self, config: Config, *, resume: bool = False, resume_from: Optional[str | Path] = None) -> None:
        self.config = config
        self.run_dir = Path(config.trainer.output_dir)
        self.save_dir = str(config.checkpoint_save_dir)
        self.resume_from = resume_from
        resuming = resume or resume_from is not None
        self.point = _resume_point(config, self.save_dir, resume_from) if resuming else None
        self.start_step: int = self.point[1]["step"] if self.point else 0
        """The step the run continues after (0: a new run)."""
        self.last: Optional[str] = str(self.point[0]) if self.point else None
        """The last checkpoint written (or resumed from)."""
        self.last_save_s = 0.0
        """Seconds the last :meth:`save` took."""
        self.complete = self.point is not None and self.start_step >= config.trainer.num_steps
        """The run was complete before it started: nothing is to run."""
        if self.complete:
            logger.info(
                "%s is at step %d of %d: the run is complete", self.last, self.start_step, config.trainer.num_steps
            )
        if self.point is None:
            _refuse_a_save_dir_with_checkpoints(config, self.save_dir)
        self._earlier_attempt = self.point is None and _earlier_attempt(self.run_dir)
        self._num_prompts: Optional[int] = None
        self._actor = self._stepper = None

    @property
    def resumed_after(self) -> Optional[int]:
        """The step a resumed run continues after; None for a new run."""
        return self.start_step if self.point is not None else None

    def check_data(self, num_prompts: int, loader) -> None:
        """Refuse training data that no longer matches the saved position; else move
        ``loader`` to it."""
        self._num_prompts = num_prompts
        if self.point is not None:
            _check_resumable(self.point, self.config, num_prompts)
            loader.load_state_dict(self.point[1]["data"])

    def restore(self, actor, stepper) -> None:
        """The resume point's actor state and the stepper's (the batch generated ahead, the
        sampler's state); the run's initial weights for a new run. Both are what
        :meth:`save` saves from then on."""
        self._actor, self._stepper = actor, stepper
        if self.point is None:
            load_initial_weights(actor, self.config)
            return
        path, state = self.point
        restored = actor.load_checkpoint(str(path), self.config.trainer.seed)
        if restored != self.start_step:
            raise ConfigError(f"{path}: the actor is at step {restored}, its trainer state at {self.start_step}")
        logger.info("resumed from %s: continuing after step %d", path, self.start_step)
        ahead_file = state.get("generated_ahead")
        if ahead_file is not None and not isinstance(ahead_file, str):
            raise ConfigError(
                f"{path}: its batch generated ahead is in the JSON format of an earlier version; resume it "
                "with that version, or start a new run from its weights (checkpoint.load_dir, without --resume)"
            )
        if ahead_file:
            samples, extra = load_samples(path / ahead_file)
            stepper.load_state_dict((samples, extra["metrics"], extra["times"]))
        if state.get("stream_state") and self.config.rollout.streaming:
            stepper.sampler.load_state_dict(torch.load(path / state["stream_state"], weights_only=True))

    def begin(self) -> None:
        """The run has started: from now on its files change (a run refused earlier left
        none). An earlier attempt's files go aside, checkpoints after ``resume_from``
        are superseded, and the resolved config is written."""
        if self._earlier_attempt:
            _set_earlier_attempt_aside(self.run_dir)
        if self.resume_from is not None:
            _supersede_later_checkpoints(self.save_dir, self.point[0], self.start_step)
        name = f"config.resumed_at_step_{self.start_step}.yaml" if self.point else "config.yaml"
        (self.run_dir / name).write_text(self.config.to_yaml())

    def due(self, step: int) -> bool:
        """Whether ``checkpoint.save_every`` asks for a checkpoint of ``step`` (the last
        step always has one, unless saving is off)."""
        every = self.config.checkpoint.save_every
        return bool(every) and (step % every == 0 or step == self.config.trainer.num_steps)

    def save(self, step: int) -> str:
        """The actor's checkpoint of ``step``, with the trainer's state inside it, and the
        batch generated ahead and the sampler's state when there are any (written once by
        the driver, moved in by the actor's save)."""
        start = time.perf_counter()
        kept, moved = self._stepper.checkpoint_state(), {}
        if kept.ahead is not None:
            moved[GENERATED_AHEAD] = str(self._partial(GENERATED_AHEAD, step))
            samples, rollout_metrics, times = kept.ahead
            save_samples(moved[GENERATED_AHEAD], samples, {"metrics": rollout_metrics, "times": times})
        if kept.sampler is not None:  # carried groups and partial responses
            moved[STREAM_STATE] = str(self._partial(STREAM_STATE, step))
            torch.save(kept.sampler, moved[STREAM_STATE])
        files = {name: name if name in moved else None for name in (GENERATED_AHEAD, STREAM_STATE)}
        state = _trainer_state(
            step, kept.data, self.config, self._num_prompts, files[GENERATED_AHEAD], files[STREAM_STATE]
        )
        try:
            self.last = self._actor.save(self.save_dir, self.config.checkpoint.keep_last, {TRAINER_STATE: state}, moved)
        finally:
            for path in moved.values():
                Path(path).unlink(missing_ok=True)  # moved in by a successful save
        self.last_save_s = time.perf_counter() - start
        return self.last

    def ensure(self, step: int) -> str:
        """The checkpoint of ``step``: the last one when it is of ``step``, else saved now."""
        if self.last is None or Path(self.last) != checkpoint_dir(self.save_dir, step):
            self.save(step)
        return self.last

    def _partial(self, name: str, step: int) -> Path:
        partial = Path(self.save_dir) / f".{name}.step_{step}.partial"
        partial.parent.mkdir(parents=True, exist_ok=True)
        return partial
