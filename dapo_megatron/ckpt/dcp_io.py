"""Stream tensors into and out of megatron's ``torch_dist`` checkpoints, one chunk at a time.

A megatron dist checkpoint is a PyTorch Distributed Checkpoint (DCP) folder plus
``metadata.json`` (which backend wrote it) and ``common.pt`` (non-tensor state). Layer
parameters are stored as one global tensor per parameter name with the layer as the
first axis (``[num_layers, ...]``), written in chunks (one per layer and tensor-parallel
slice). Any process can read any region of it without a process group.

Converting a 32B model must not need a machine that holds it twice. So:

- :func:`write_dist_checkpoint` plans every chunk from shapes alone and produces each
  chunk's data only when DCP's writer asks for it (``resolve_data``), so at most one
  chunk is alive at a time and nothing is accumulated;
- :func:`read_chunk` reads one region (e.g. one layer of one parameter) by asking DCP
  for exactly the stored chunks that overlap it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


@dataclass(frozen=True)
class ChunkSpec:
    """One stored chunk of a global tensor, produced on demand."""

    key: str
    """Megatron's sharded key (the DCP fully-qualified name)."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor, e.g. ``(num_layers, out, in)`` for a layer parameter."""
    offsets: tuple[int, ...]
    """Where this chunk starts in the global tensor."""
    sizes: tuple[int, ...]
    """Shape of this chunk."""
    dtype: torch.dtype
    """Stored dtype."""
    produce: Callable[[], torch.Tensor]
    """Returns the chunk's data (shape ``sizes``); called once, when it is written."""


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans writes from :class:`ChunkSpec` shapes; materialises each chunk when written."""

    def __init__(self, chunks: list[ChunkSpec], on_written: Optional[Callable[[ChunkSpec, torch.Tensor], None]]):
        super().__init__(flatten_state_dict=False)
        self._chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}
        self._on_written = on_written

    def create_local_plan(self) -> SavePlan:
        items = []
        for index, chunk in self._chunks.items():
            properties = TensorProperties(dtype=chunk.dtype)
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                        properties=properties,
                        size=torch.Size(chunk.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        chunk = self._chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        data = chunk.produce()
        if tuple(data.shape) != tuple(chunk.sizes) or data.dtype != chunk.dtype:
            raise ValueError(
                f"{chunk.key} at offset {chunk.offsets}: produced {tuple(data.shape)} {data.dtype}, "
                f"planned {tuple(chunk.sizes)} {chunk.dtype}"
            )
        data = data.contiguous()
        if self._on_written is not None:
            self._on_written(chunk, data)
        return data


def write_dist_checkpoint(
    out_dir: str | os.PathLike,
    chunks: Iterable[ChunkSpec],
    *,
    on_written: Optional[Callable[[ChunkSpec, torch.Tensor], None]] = None,
) -> None:
    """Write a megatron ``torch_dist`` checkpoint from chunk specs, streaming.

    ``on_written(chunk, data)`` is called as each chunk is produced (for progress).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(
        {},
        storage_writer=FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1),
        planner=_StreamingSavePlanner(list(chunks), on_written),
        no_dist=True,
    )
    torch.save({}, out / "common.pt")
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


def is_dist_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a megatron torch_dist checkpoint."""
    path = Path(path)
    if not (path / "metadata.json").is_file() or not (path / ".metadata").is_file():
        return False
    try:
        return json.loads((path / "metadata.json").read_text()).get("sharded_backend") == "torch_dist"
    except json.JSONDecodeError:
        return False


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor stored in a dist checkpoint."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads one region of one stored tensor into a preallocated destination."""

    def __init__(self, key: str, offsets: tuple[int, ...], destination: torch.Tensor):
        super().__init__(flatten_state_dict=False)
        self._key, self._offsets, self._destination = key, offsets, destination

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import LoadPlan

        stored = self.metadata.state_dict_metadata[self._key]
        wanted = ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=self._destination.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, stored, [wanted]))

    def resolve_tensor(self, read_item):
        region = self._destination
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            region = region.narrow(dim, start, length)
        return region

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class _CachedMetadataReader(FileSystemReader):
    """A FileSystemReader that parses ``.metadata`` once, not on every read."""

    def read_metadata(self):
        if not hasattr(self, "_cached_metadata"):
            self._cached_metadata = super().read_metadata()
        return self._cached_metadata


_READERS: dict[str, _CachedMetadataReader] = {}


def read_chunk(
    path: str | os.PathLike,
    key: str,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The region ``[offsets, offsets + sizes)`` of stored tensor ``key``, however it was chunked."""
    location = str(Path(path).resolve())
    stamp = f"{location}:{os.stat(Path(location) / '.metadata').st_mtime_ns}"
    reader = _READERS.get(stamp)
    if reader is None:
        reader = _READERS[stamp] = _CachedMetadataReader(location)
    destination = torch.empty(sizes, dtype=dtype)
    dcp.load(
        {key: destination}, storage_reader=reader, planner=_RegionLoadPlanner(key, offsets, destination), no_dist=True
    )
    return destination


LATEST = "latest"
"""File in a save folder naming its newest complete checkpoint."""


def latest_checkpoint(load_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``latest`` points at in ``load_dir`` (or ``load_dir`` itself if it is
    one), or None when there is none yet."""
    path = Path(load_dir)
    if is_dist_checkpoint(path):
        return path
    marker = path / LATEST
    if not marker.exists():
        return None
    try:
        target = path / json.loads(marker.read_text())["path"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FileNotFoundError(f"{marker} is damaged (not the JSON a save writes: {exc})") from None
    if not is_dist_checkpoint(target):
        raise FileNotFoundError(f"{marker} points at {target}, which is not a complete checkpoint")
    return target


def _load_common(path: Path) -> object:
    """``common.pt`` loaded as megatron's own load does (``torch.load``'s default,
    weights-only: it builds tensors, plain containers and values, and the classes registered
    as safe, and calls nothing else a pickle names, so a planted file runs no code here).
    Megatron registers a few classes of its own as safe when ``megatron.core`` is imported;
    a file that needs one is loaded again with them."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            import megatron.core  # noqa: F401  (registers megatron's safe classes with torch)
        except ImportError:
            raise exc from None
        return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_problem(path: str | os.PathLike) -> Optional[str]:
    """Why the dist checkpoint in ``path`` cannot be loaded, or None when every file it
    needs is there in full: ``metadata.json``, ``common.pt`` and DCP's ``.metadata``
    readable, and every shard file at least as long as the last byte DCP's index says it
    holds (a truncated copy or a disk that filled up shows here, in milliseconds, instead
    of as an ``EOFError`` in the ranks a minute into the load)."""
    path = Path(path)
    if not is_dist_checkpoint(path):
        return f"{path / 'metadata.json'} or {path / '.metadata'} is missing or unreadable"
    try:
        _load_common(path / "common.pt")
    except Exception as exc:  # EOFError, UnpicklingError, RuntimeError: a damaged file
        refused = re.search(r"WeightsUnpickler error: ([^\n]*)", str(exc))
        if refused:
            return (
                f"{path / 'common.pt'} cannot be loaded safely ({refused.group(1)}): it holds an object that "
                "torch's weights-only loader, which megatron's own load uses too, does not build; a checkpoint's "
                "common.pt holds plain values and tensors only"
            )
        return f"{path / 'common.pt'} is damaged ({type(exc).__name__}: {exc})"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        return f"{path / '.metadata'} is damaged ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing"
        if shard.stat().st_size < size:
            return f"{shard} is truncated: {shard.stat().st_size:,} bytes, its index needs {size:,}"
    return None
