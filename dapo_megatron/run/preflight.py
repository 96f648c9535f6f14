"""Checks of a config against the world it will run in, before anything starts.

``config.validate`` checks a config's values against each other; it cannot see whether
the files a config names exist, whether ``algorithm.reward_fn`` names a function that can
be imported (``rollout.env`` a class), whether the run folder can be written, or whether the tokenizer's ids fit
the model. Found late, each of those is a traceback after Ray and the ranks have started
(a minute in, on a cluster much longer). :func:`preflight` finds them first: ``train``,
``eval``, ``bench`` and ``config`` (which makes ``dapo-megatron config`` a pre-flight for a
job) all run it, and every failure is a :class:`ConfigError` naming the key, where its
value came from, and what to do (exit 2 on the command line).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from dapo_megatron.config import Config, ConfigError, source_of

_DEMO_HINT = " (for the demo, run `make demo` or examples/demo/prepare.py first)"


def _fail(config: Config, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source_of(config, key)}: {key}: {message}")


def check_reward(config: Config) -> None:
    """``algorithm.reward_fn`` names a registered reward or an importable ``module:function``."""
    from dapo_megatron.algo.rewards.registry import resolve_reward

    try:
        resolve_reward(config.algorithm.reward_fn)
    except ValueError as exc:
        raise _fail(config, "algorithm.reward_fn", str(exc)) from None


def check_wandb(config: Config) -> None:
    """``logging.wandb`` needs the ``wandb`` package."""
    if not config.logging.wandb:
        return
    from dapo_megatron.run.wandb_sink import import_wandb

    try:
        import_wandb()
    except ImportError as exc:
        raise _fail(config, "logging.wandb", str(exc)) from None


def check_environment(config: Config) -> None:
    """``rollout.env`` names a registered environment or an importable ``module:Class``,
    which ``rollout.env_options`` build."""
    if config.rollout.env is None:
        return
    from dapo_megatron.sampling.environments import make_environment, resolve_environment

    try:
        resolve_environment(config.rollout.env)
    except ValueError as exc:
        raise _fail(config, "rollout.env", str(exc)) from None
    try:
        make_environment(config.rollout.env, config.rollout.env_options)
    except ValueError as exc:
        raise _fail(config, "rollout.env_options", str(exc)) from None


def _demo_hint(path: str) -> str:
    return _DEMO_HINT if "runs/demo" in Path(path).as_posix() else ""


def check_inputs_exist(config: Config) -> None:
    """Every file and folder the run reads exists: the data files, the tokenizer, the
    initial weights, the checkpoint to load."""
    d, m, c = config.data, config.model, config.checkpoint
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for index, file in enumerate(files):
            if not Path(file).is_file():
                what = "is a folder, not a data file" if Path(file).is_dir() else "no such data file"
                raise _fail(config, f"{key}[{index}]", f"{file}: {what}{_demo_hint(file)}")
    for key, folder in (("data.tokenizer", d.tokenizer), ("model.hf_weights", m.hf_weights)):
        if folder is not None and not Path(folder).is_dir():
            raise _fail(config, key, f"{folder}: no such folder{_demo_hint(folder)}")
    if c.load_dir is not None and not Path(c.load_dir).exists():
        raise _fail(config, "checkpoint.load_dir", f"{c.load_dir}: no such checkpoint or save folder")


def _unwritable(folder: Path) -> Optional[str]:
    """Why files cannot be created in ``folder`` (which may not exist yet), or None."""
    folder = folder.absolute()
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            if not candidate.is_dir():
                return f"{candidate} is a file, not a folder"
            if not os.access(candidate, os.W_OK | os.X_OK):
                return f"{candidate} is not writable by this user"
            return None
    return f"none of {folder}'s parent folders exists"


def check_output_dirs(config: Config) -> None:
    """The run folder and the checkpoint folder can be created and written."""
    keys = [("trainer.output_dir", config.trainer.output_dir)]
    if config.checkpoint.save_dir is not None:
        keys.append(("checkpoint.save_dir", config.checkpoint.save_dir))
    for key, folder in keys:
        why = _unwritable(Path(folder))
        if why is not None:
            raise _fail(config, key, f"cannot write the run's files to {folder}: {why}; choose another folder")


def check_tokenizer_fits(config: Config, tokenizer, datasets) -> None:
    """Every token id that can reach the model is inside its vocabulary: the prompts' of
    ``datasets`` (each a :class:`~dapo_megatron.data.PromptDataset`) and the EOS and pad
    ids. An id beyond it fails deep inside the engine's embedding lookup, long after the
    start. (A tokenizer may define more ids than the model has, e.g. unused added special
    tokens; only the ids a run uses must fit.)"""
    vocab = config.model.vocab_size
    key = "data.tokenizer" if config.data.tokenizer is not None else "model.hf_weights"
    used = {"the EOS token": tokenizer.eos_token_id, "the pad token": tokenizer.pad_token_id}
    for dataset in datasets:
        for prompt in dataset.prompts:
            largest = max(prompt.token_ids)
            if largest >= vocab:
                used[f"prompt {prompt.prompt_id} ({prompt.data_source})"] = largest
                break
    for what, token in used.items():
        if token is not None and token >= vocab:
            raise _fail(
                config,
                key,
                f"{what} has token id {token}, but the model's vocabulary has {vocab} entries (model.vocab_size, "
                f"from model.hf_config; the tokenizer defines {len(tokenizer)}): use the tokenizer the model was "
                "trained with",
            )


def preflight(config: Config) -> None:
    """Every check above that needs no tokenizer (:func:`check_tokenizer_fits` runs where
    the tokenizer is loaded)."""
    check_reward(config)
    check_environment(config)
    check_wandb(config)
    check_inputs_exist(config)
    check_output_dirs(config)
