"""Prompts for the trainer: read, checked, rendered, tokenized, and served in seeded epochs.

Files are parquet (pyarrow) or JSONL rows in the DAPO-Math-17k schema: ``prompt`` a list
of chat messages (``{"role", "content"}``; plain text is accepted too),
``reward_model.ground_truth`` the reference answer, ``data_source`` where it came from
(the keys are ``DataConfig``'s). A row that lacks a column or holds a malformed prompt is
refused with the file, the row and the column named: a silently skipped row would change
the data without anyone knowing.

Prompts are rendered with the tokenizer's chat template (with the generation prompt), or
with a plain template (the messages' contents, one per line) when it has none. Prompts
longer than ``rollout.max_prompt_length`` tokens are dropped and counted.

The published files repeat rows: ``dapo-math-17k.parquet`` holds each of its ~17k prompts
100 times (1.79M rows) and ``aime-2024.parquet`` each of its 30 problems 32 times. The
loader reports the number of distinct prompts of every file and, with
``data.deduplicate``, keeps one copy of each (prompt text and answer).

:class:`PromptLoader` serves batches in epochs, reshuffled with a seeded generator each
epoch; its position (epoch, index) is part of the trainer's state.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dapo_megatron.config import ConfigError, DataConfig

logger = logging.getLogger(__name__)


class DataError(ConfigError):
    """A data file cannot be used; the message names the file, the row and the column."""


@dataclass(frozen=True)
class Prompt:
    """One prompt as the trainer uses it."""

    prompt_id: int
    """Index of the prompt in its dataset (after deduplication): the identity of its group."""
    token_ids: tuple[int, ...]
    """The rendered prompt's tokens."""
    ground_truth: str
    """Reference answer."""
    data_source: str
    """Where the prompt came from (the ``data_source`` column, or the file name)."""
    text: str
    """The rendered prompt."""


def load_tokenizer(data: DataConfig, model_folder: Optional[Path]):
    """The HF tokenizer of ``data.tokenizer``, or of the model's folder (``hf_weights_folder``)."""
    from transformers import AutoTokenizer

    folder = data.tokenizer
    if folder is None and model_folder is not None:
        folder = str(model_folder)
    if folder is None:
        raise ConfigError(
            "data.tokenizer is unset and neither model.hf_weights nor model.hf_config names a folder; set data.tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.tokenizer={folder!r}: cannot load a tokenizer there: {exc}") from None


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a data file; ``where`` says where the row is as its
    reader would look for it: ``line N`` (1-based, as editors number them) in JSONL,
    ``row N`` (0-based, as pandas and pyarrow index them) in parquet."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a broken file
            raise DataError(f"{path}: not a readable parquet file: {exc}") from None
        return [(f"row {number}", row) for number, row in enumerate(rows)]
    if suffix in (".jsonl", ".json"):
        rows = []
        # Bytes, decoded line by line: a stray non-UTF-8 byte is then a refused line like
        # any other, not a UnicodeDecodeError that names neither the file nor the line.
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{path}: line {number}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte "
                        f"{exc.start + 1} of the line); JSONL data must be UTF-8, re-encode the file"
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {number}: not valid JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}: line {number}: expected a JSON object, found {type(row).__name__}")
                rows.append((f"line {number}", row))
        return rows
    raise DataError(f"{path}: unsupported data file type {suffix!r}; use .parquet or .jsonl")


def _lookup(row: dict[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if hasattr(value, "tolist"):  # numpy arrays from parquet readers
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: expected a non-empty list of chat messages or a string, found {value!r:.80}")
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(f"{where}: every message needs a string 'role' and 'content', found {message!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text: the tokenizer's chat template, or the contents one per line."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(message["content"] for message in messages)


class PromptDataset:
    """All prompts of a list of files, checked, rendered and tokenized.

    Attributes after loading: ``prompts``, and ``stats`` with ``rows`` read,
    ``distinct`` prompts, ``duplicates_removed`` and ``dropped_too_long``.
    """

    def __init__(self, files: list[str], tokenizer, data: DataConfig, max_prompt_length: int) -> None:
        self.prompts: list[Prompt] = []
        self.stats = {"rows": 0, "distinct": 0, "duplicates_removed": 0, "dropped_too_long": 0}
        seen: set[tuple[str, str]] = set()
        for file in files:
            path = Path(file)
            rows = _read_rows(path)
            distinct_in_file: set[tuple[str, str]] = set()
            removed_before = self.stats["duplicates_removed"]
            for place, row in rows:
                where = f"{path}: {place}"
                values = {}
                for setting, column in (("prompt_key", data.prompt_key), ("answer_key", data.answer_key)):
                    try:
                        values[setting] = _lookup(row, column)
                    except KeyError:
                        raise DataError(
                            f"{where}: column {column!r} is missing (data.{setting}={column!r}); "
                            f"found columns {sorted(row)}"
                        ) from None
                messages = _messages(values["prompt_key"], f"{where}: column {data.prompt_key!r}")
                if data.system_prompt is not None and messages[0]["role"] != "system":
                    messages = [{"role": "system", "content": data.system_prompt}, *messages]
                answer = values["answer_key"]
                if answer is None or isinstance(answer, (dict, list)) or not str(answer).strip():
                    raise DataError(
                        f"{where}: column {data.answer_key!r} must hold an answer, found {answer!r:.80} (a prompt "
                        "without one can never be scored correct)"
                    )
                try:
                    source = str(_lookup(row, data.data_source_key))
                except KeyError:
                    source = path.stem
                text = render_prompt(tokenizer, messages)
                key = (text, str(answer))
                distinct_in_file.add(key)
                self.stats["rows"] += 1
                if data.deduplicate and key in seen:
                    self.stats["duplicates_removed"] += 1
                    continue
                seen.add(key)
                ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
                if len(ids) > max_prompt_length:
                    self.stats["dropped_too_long"] += 1
                    continue
                if not ids:
                    raise DataError(f"{where}: column {data.prompt_key!r} renders to an empty prompt")
                self.prompts.append(Prompt(len(self.prompts), ids, str(answer), source, text))
            repeats = len(rows) - len(distinct_in_file)
            dropped = self.stats["duplicates_removed"] - removed_before
            if data.deduplicate:
                note = f"; data.deduplicate kept {len(rows) - dropped}, dropped {dropped} repeated rows"
            elif repeats:
                note = f"; {repeats} rows repeat another (data.deduplicate=true keeps one copy of each)"
            else:
                note = ""
            logger.info("%s: %d rows, %d distinct prompts%s", path, len(rows), len(distinct_in_file), note)
        self.stats["distinct"] = len(seen)
        if self.stats["dropped_too_long"]:
            logger.warning(
                "dropped %d prompts longer than rollout.max_prompt_length=%d tokens",
                self.stats["dropped_too_long"],
                max_prompt_length,
            )
        if files and not self.prompts:
            raise DataError(f"{', '.join(files)}: no usable prompts (all {self.stats['rows']} rows dropped)")

    def __len__(self) -> int:
        return len(self.prompts)


class PromptLoader:
    """Batches of prompts in epochs, shuffled with a seeded generator each epoch."""

    def __init__(self, dataset: PromptDataset, *, seed: int, shuffle: bool) -> None:
        if not len(dataset):
            raise DataError("the training data holds no prompts")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Prompt]:
        """The next ``size`` prompts, crossing into a new (reshuffled) epoch when needed."""
        batch = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(size - len(batch), len(self._order) - self.position)
            batch.extend(self.dataset.prompts[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the loader is: epoch and position in that epoch's order."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from :meth:`state_dict`'s position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def validation_dataset(files: list[str], tokenizer, data: DataConfig, max_prompt_length: int) -> PromptDataset:
    """The validation problems, each counted once.

    Published evaluation files repeat problems (the AIME 2024 parquet holds each of its 30
    problems 32 times, for avg@32 by repetition); avg@k here samples k responses per
    problem instead, so repeats would only weight some problems more than others.
    """
    from dataclasses import replace

    dataset = PromptDataset(files, tokenizer, replace(data, deduplicate=True), max_prompt_length)
    if dataset.stats["duplicates_removed"]:
        logger.info(
            "validation: %d rows hold %d distinct problems; each is counted once (k samples per problem)",
            dataset.stats["rows"],
            len(dataset.prompts),
        )
    return dataset


def decoded_prompt(prompt: Prompt, tokenizer) -> str:
    """What ``prompt``'s tokens decode back to: the text the model actually gets. It
    differs from ``prompt.text`` when the tokenizer cannot represent some of the rendered
    characters (a small demo vocabulary drops them silently)."""
    return tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)


def describe_prompt(dataset: PromptDataset, index: int, tokenizer) -> str:
    """Prompt ``index`` of ``dataset`` as the model gets it: where it came from, the
    rendered text, its token count and ids, and the decoded tokens when they differ."""
    if not 0 <= index < len(dataset.prompts):
        raise DataError(f"--show-prompt {index}: the training data holds prompts 0 to {len(dataset.prompts) - 1}")
    prompt = dataset.prompts[index]
    decoded = decoded_prompt(prompt, tokenizer)
    lines = [
        f"prompt {index} of {len(dataset.prompts)} (data source {prompt.data_source!r}, answer {prompt.ground_truth!r})",
        "--- rendered (chat template or plain) ---",
        prompt.text,
        f"--- {len(prompt.token_ids)} tokens ---",
        " ".join(str(t) for t in prompt.token_ids),
    ]
    if decoded == prompt.text:
        lines.append("--- the tokens decode back to the rendered text exactly ---")
    else:
        lines += [
            f"--- WARNING: the tokens decode to {len(decoded)} of the text's {len(prompt.text)} characters: the "
            "tokenizer cannot represent the rest, and the model never sees it ---",
            decoded,
        ]
    return "\n".join(lines)


def warn_if_prompts_lose_text(dataset: PromptDataset, tokenizer) -> None:
    """Log the first prompt as the model gets it; warn when its tokens do not decode back
    to the rendered text (see :func:`decoded_prompt`)."""
    if not dataset.prompts:
        return
    first = dataset.prompts[0]
    decoded = decoded_prompt(first, tokenizer)
    if decoded == first.text:
        logger.info("the first training prompt, as the model gets it (%d tokens): %r", len(first.token_ids), decoded)
    else:
        logger.warning(
            "the tokenizer cannot represent the rendered prompts: the first one renders to %r but its %d tokens "
            "decode to %r; the model never sees the rest (`dapo-megatron config CONFIG --show-prompt 0` shows it)",
            first.text,
            len(first.token_ids),
            decoded,
        )
