"""Reading what W&B wrote offline: the records of a ``.wandb`` file (a LevelDB-style log
after a 7-byte header: 32 KiB blocks of records, each a CRC, a length, a kind and a
protobuf ``Record``), for tests that check every metric reached the W&B run."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32768
HEADER = 7


def _records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = HEADER, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            position += left
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind, chunk = data[position + 6], data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:
            return


def history(run_folder: Path) -> dict[int, dict]:
    """Every history row of every W&B run file under ``run_folder`` (offline runs),
    by step: ``{step: {name: value}}`` (a table as its metadata, ``name/nrows``...)."""
    from wandb.proto import wandb_internal_pb2

    rows: dict[int, dict] = {}
    for path in sorted(Path(run_folder).glob("wandb/offline-run-*/run-*.wandb")):
        for raw in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def run_ids(run_folder: Path) -> set[str]:
    """The W&B run ids of the offline runs under ``run_folder``."""
    return {path.stem.removeprefix("run-") for path in Path(run_folder).glob("wandb/offline-run-*/run-*.wandb")}
