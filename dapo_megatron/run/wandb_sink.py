"""Weights & Biases beside TensorBoard and ``metrics.jsonl`` (``logging.wandb``).

The same metrics under the same names and steps as the other sinks, the run's resolved
config, and every ``wandb_table_every`` steps a table of sampled responses (the rows of
the rollout records). ``wandb`` is an optional extra, imported only when a run asks for
it. The W&B run's id is kept in ``<output_dir>/wandb_run_id``: a resumed run continues the
same W&B run, and its earlier steps are not logged again (the trainer logs only the
steps after its checkpoint). ``logging.wandb_mode: offline`` writes the run under
``<output_dir>/wandb`` without any network (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Optional

from dapo_megatron.config import LoggingConfig

RUN_ID_FILE = "wandb_run_id"
TABLE_COLUMNS = ("step", "prompt", "response", "reward", "correct", "advantage", "kept", "dropped")


def import_wandb():
    """The ``wandb`` module; ImportError naming the extra to install."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"logging.wandb=true needs the wandb package ({exc}): pip install -e '.[wandb]' (or pip install wandb)"
        ) from None
    return wandb


class WandbSink:
    """One W&B run for one run folder (see the module docstring)."""

    def __init__(self, run_dir: str | Path, config: LoggingConfig, run_config: dict, *, resume: bool) -> None:
        wandb = import_wandb()
        self.run_dir = Path(run_dir)
        id_file = self.run_dir / RUN_ID_FILE
        if resume and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(6)  # W&B ids: lower-case letters and digits
            id_file.write_text(run_id + "\n")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.wandb_name or self.run_dir.name,
            tags=list(config.wandb_tags),
            mode=config.wandb_mode,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            config=run_config,
        )
        self.config, self.run_id = config, run_id
        self._wandb = wandb

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of ``rows`` (rollout records' rows) at ``step``."""
        data = [[row.get(column) for column in TABLE_COLUMNS] for row in rows]
        self.run.log({"rollouts/samples": self._wandb.Table(columns=list(TABLE_COLUMNS), data=data)}, step=step)

    def wants_table(self, step: int) -> bool:
        every = self.config.wandb_table_every
        return every > 0 and step % every == 0

    def where(self) -> str:
        """Where the run went, for the run's summary."""
        if self.config.wandb_mode == "offline":
            return f"W&B offline run {self.run_id} in {self.run_dir / 'wandb'} (wandb sync uploads it)"
        url: Optional[str] = getattr(self.run, "url", None)
        return f"W&B run {self.run_id}" + (f" {url}" if url else "")

    def close(self) -> None:
        self.run.finish()
