"""HF <-> Megatron checkpoint conversion for every supported model family: exact, streaming, verified.

Both directions stream tensor by tensor through :mod:`mapping` (the single source
of truth for names and layouts): HF safetensors are opened per read (memory-mapped, and
closed again so their pages do not pile up), each Megatron chunk is produced only when
the writer asks for it, and HF shards are flushed as they fill. Peak memory is therefore
about one HF shard (megatron -> HF) or one layer's tensors (HF -> megatron), not the
model.

Output goes to ``<out>.tmp-<pid>`` and is renamed to ``<out>`` only once it is complete
and, with ``verify``, its logits match ``transformers``' own model of the family on the same
prompts. An existing ``<out>`` is refused unless ``overwrite`` is set, and even then it is
replaced only after the new one is complete, so a failed conversion never loses data or
leaves a folder that looks finished. An ``<out>`` that is an input, or contains one, is
refused up front: replacing it would delete the input.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.ckpt import dcp_io
from dapo_megatron.ckpt.hf_checkpoint import ConversionError, HFCheckpoint
from dapo_megatron.ckpt.mapping import (
    VOCAB_KEYS,
    ModelShape,
    hf_names_of,
    hf_shapes,
    megatron_shapes,
    megatron_tensor_order,
    stacked,
    stored_key,
    to_hf,
    to_megatron,
)
from dapo_megatron.config import ConfigError, read_hf_model_shape

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
VERIFY_AUTO_MAX_BYTES = 2 * 2**30
"""``verify="auto"`` compares logits only for checkpoints up to this size (CPU, fp32)."""


@dataclass
class ConversionReport:
    """What a conversion did."""

    out: Path
    """The finished output folder."""
    num_tensors: int
    """Tensors written."""
    num_bytes: int
    """Bytes of tensor data written."""
    verified: bool
    """Whether logits were compared with transformers."""
    max_logit_error: Optional[float] = None
    """Largest |logit difference| / largest |logit| when verified."""


# ------------------------------------------------------------------ shared helpers


def _shape_from_hf_config(path: str | os.PathLike) -> ModelShape:
    try:
        return ModelShape.from_model_config(read_hf_model_shape(path))
    except ConfigError as exc:
        raise ConversionError(str(exc).replace("model.hf_config=", "config ")) from None


def _refuse_output_over_input(out: Path, inputs: dict[str, Path]) -> None:
    """Refuse an ``out`` that is one of ``inputs`` (what -> path) or contains one.

    Publishing replaces ``out`` whole, so with ``overwrite`` a conversion that succeeded
    would delete such an input; without it, "already exists" would hide the real problem.
    An ``out`` inside an input is allowed: it only adds a folder there (the inputs are read
    by name: HF safetensors and config files at the top, DCP files by its index)."""
    target = out.resolve()
    for what, path in inputs.items():
        source = path.resolve()
        if source == target or target in source.parents:
            relation = "is" if source == target else "contains"
            raise ConversionError(
                f"output folder {out} {relation} the input {what} {path}; replacing it would delete the input: "
                f"choose an --out outside {source}"
            )


def _prepare_output(out: Path, overwrite: bool) -> Path:
    if out.exists() and not overwrite:
        raise ConversionError(f"output folder {out} already exists; choose another --out or pass --overwrite")
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


@contextlib.contextmanager
def _staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; publish it as ``out`` if the body succeeds,
    delete it if the body raises (``out`` is then untouched)."""
    staging = _prepare_output(out, overwrite)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out)


def _publish(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` folder to ``out``; an old ``out`` goes only afterwards."""
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old)


class _Progress:
    """A tqdm bar over bytes written (silent when disabled)."""

    def __init__(self, total_bytes: int, total_tensors: int, desc: str, enabled: bool) -> None:
        self.bar = None
        self.tensors = 0
        self.total_tensors = total_tensors
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

    def update(self, num_bytes: int, count: int = 1) -> None:
        self.tensors += count
        if self.bar is not None:
            self.bar.update(num_bytes)
            self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _region(full: tuple[int, ...], layer: Optional[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of one layer of a stacked tensor, or of a whole unstacked one."""
    if layer is None:
        return (0,) * len(full), tuple(full)
    return (layer,) + (0,) * (len(full) - 1), (1, *full[1:])


def _stored_chunk(shape: ModelShape, key: str, layer: Optional[int], shapes: dict) -> tuple:
    """``(stored key, offsets, sizes, layer axis)`` of layer ``layer``'s slice of Megatron
    tensor ``key`` in a checkpoint whose tensors have ``shapes`` (key -> global shape):
    one layer of a stacked tensor, or the whole of a per-layer (or unstacked) one."""
    stored = stored_key(shape, key, layer)
    layer_axis = layer is not None and stacked(shape)
    offsets, sizes = _region(tuple(shapes[stored]), layer if layer_axis else None)
    return stored, offsets, sizes, layer_axis


def _should_verify(verify: bool | str, num_bytes: int) -> bool:
    if verify == "auto":
        return num_bytes <= VERIFY_AUTO_MAX_BYTES
    return bool(verify)


# ------------------------------------------------------------------ HF side


def _torch_dtype(safetensors_dtype: str) -> torch.dtype:
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
    if safetensors_dtype not in names:
        raise ConversionError(f"unsupported tensor dtype {safetensors_dtype}")
    return names[safetensors_dtype]


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy the tokenizer and generation files that exist in ``source``."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
            copied.append(name)
    return copied


# ------------------------------------------------------------------ HF -> Megatron


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    verify: bool | str = "auto",
    dtype: Optional[torch.dtype] = None,
    progress: bool = True,
) -> ConversionReport:
    """Convert an HF checkpoint (any supported family) into a Megatron ``torch_dist`` checkpoint.

    ``dtype``: cast tensors to this dtype (default: as stored in the HF files).
    """
    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_output_over_input(out, {"--hf-dir": hf_dir})
    shape = _shape_from_hf_config(hf_dir)
    hf = HFCheckpoint(hf_dir)
    hf.check_against(shape)
    global_shapes = megatron_shapes(shape)
    chunks = []
    for key, layer in megatron_tensor_order(shape):
        names = hf_names_of(key, layer, shape)
        out_dtype = dtype or _torch_dtype(hf.dtypes[names[0]])
        stored, offsets, sizes, layer_axis = _stored_chunk(shape, key, layer, global_shapes)

        def produce(key=key, names=names, layer_axis=layer_axis, out_dtype=out_dtype) -> torch.Tensor:
            tensor = to_megatron(key, [hf.read(n) for n in names], shape).to(out_dtype)
            return tensor.unsqueeze(0) if layer_axis else tensor

        chunks.append(dcp_io.ChunkSpec(stored, tuple(global_shapes[stored]), offsets, tuple(sizes), out_dtype, produce))
    total = sum(torch.Size(c.sizes).numel() * c.dtype.itemsize for c in chunks)
    report = ConversionReport(out=out, num_tensors=len(chunks), num_bytes=total, verified=False)
    with _staged_output(out, overwrite) as staging:
        with _Progress(total, len(chunks), "hf->megatron", progress) as bar:
            dcp_io.write_dist_checkpoint(staging, chunks, on_written=lambda chunk, data: bar.update(data.nbytes))
        if _should_verify(verify, total):
            _verify(hf_dir, staging, report, dtype)
    return report


# ------------------------------------------------------------------ Megatron -> HF


def _check_megatron(ckpt: Path, stored: dict, shape: ModelShape, config_path: Path) -> None:
    expected = megatron_shapes(shape)
    missing = sorted(set(expected) - set(stored))
    if missing:
        tied_hint = ""
        if missing == ["output_layer.weight"]:
            tied_hint = " (config.json says tie_word_embeddings=false; was the model trained with tied embeddings?)"
        raise ConversionError(f"{ckpt}: missing tensors: {', '.join(missing)}{tied_hint}")
    if "output_layer.weight" in stored and shape.tie_word_embeddings:
        raise ConversionError(
            f"{ckpt} has an output_layer.weight but {config_path} says tie_word_embeddings=true; "
            "the config and the checkpoint disagree"
        )
    for key, want in expected.items():
        have = stored[key][0]
        if stacked(shape) and key.startswith("decoder.layers.") and have[0] != want[0]:
            raise ConversionError(
                f"{ckpt} has {have[0]} layers ({key}) but {config_path} says num_hidden_layers={want[0]}; "
                "the config and the checkpoint disagree"
            )
        rows_ok = have[0] >= want[0] if key in VOCAB_KEYS else have[0] == want[0]
        if not rows_ok or tuple(have[1:]) != tuple(want[1:]):
            raise ConversionError(
                f"{ckpt}: tensor {key} has shape {tuple(have)}, but {config_path} implies {tuple(want)}"
                f"{' (or more rows: vocabulary padding)' if key in VOCAB_KEYS else ''}; the config and the checkpoint disagree"
            )


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


class _SafetensorsStream:
    """Write one safetensors file tensor by tensor.

    The header (names, dtypes, shapes, byte ranges) is known from the shapes alone, so it
    is written first and each tensor's bytes follow as they are produced; no shard is
    ever held in memory. The result is an ordinary safetensors file.
    """

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in entries:
            size = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._file = open(path, "wb")
        self._file.write(len(encoded).to_bytes(8, "little"))
        self._file.write(encoded)
        self._pending = list(entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self._pending.pop(0)
        if name != expected_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(
                f"safetensors stream expected {expected_name} {shape} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._file.write(tensor.contiguous().view(torch.uint8).numpy().data)

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise RuntimeError(f"safetensors stream closed with {len(self._pending)} tensors unwritten")


def megatron_to_hf(
    ckpt: str | os.PathLike,
    hf_config: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    verify: bool | str = "auto",
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
) -> ConversionReport:
    """Convert a Megatron dist checkpoint (converted or trained) into HF safetensors shards.

    Args:
        ckpt: a checkpoint folder, or a save folder whose ``latest`` names one.
        hf_config: folder with the model's ``config.json`` (and tokenizer files to copy).
        out: output folder.
        dtype: cast tensors to this dtype (default: as stored).
        max_shard_bytes: start a new safetensors file past this size.
    """
    config_dir, out = Path(hf_config), Path(out)
    _refuse_output_over_input(out, {"--ckpt": Path(ckpt), "--hf-config": config_dir})
    config_path = config_dir / "config.json" if config_dir.is_dir() else config_dir
    shape = _shape_from_hf_config(config_dir)
    try:
        checkpoint = dcp_io.latest_checkpoint(ckpt)
    except FileNotFoundError as exc:
        raise ConversionError(str(exc)) from None
    if checkpoint is None:
        raise ConversionError(f"{ckpt} is not a Megatron dist checkpoint (no metadata.json/.metadata, no 'latest')")
    _refuse_output_over_input(out, {f"checkpoint (--ckpt {ckpt}'s latest)": checkpoint})
    stored = dcp_io.tensor_shapes(checkpoint)
    _check_megatron(checkpoint, stored, shape, config_path)
    stored_shapes = {key: full for key, (full, _) in stored.items()}

    # Plan every HF tensor (name, shape, dtype) per Megatron tensor, then pack whole groups
    # into shard files, so headers can be written before any data is read.
    names_to_shapes = hf_shapes(shape)
    groups = []
    for key, layer in megatron_tensor_order(shape):
        out_dtype = dtype or stored[stored_key(shape, key, layer)][1]
        groups.append(((key, layer), [(n, names_to_shapes[n], out_dtype) for n in hf_names_of(key, layer, shape)]))
    shards: list[list] = [[]]
    shard_bytes = 0
    for group in groups:
        group_bytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in group[1])
        if shards[-1] and shard_bytes + group_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(group)
        shard_bytes += group_bytes
    file_names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(torch.Size(s).numel() * d.itemsize for _, entries in groups for _, s, d in entries)

    weight_map: dict[str, str] = {}
    with _staged_output(out, overwrite) as staging:
        staging.mkdir()
        with _Progress(total, len(names_to_shapes), "megatron->hf", progress) as bar:
            for file_name, shard in zip(file_names, shards):
                stream = _SafetensorsStream(staging / file_name, [entry for _, entries in shard for entry in entries])
                for (key, layer), entries in shard:
                    stored_name, offsets, sizes, layer_axis = _stored_chunk(shape, key, layer, stored_shapes)
                    tensor = dcp_io.read_chunk(checkpoint, stored_name, offsets, sizes, stored[stored_name][1])
                    converted = to_hf(key, tensor[0] if layer_axis else tensor, shape, layer)
                    for name, _, out_dtype in entries:
                        value = converted[name].to(out_dtype)
                        stream.write(name, value)
                        weight_map[name] = file_name
                        bar.update(value.nbytes)
                stream.close()
        if len(file_names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        shutil.copy2(config_path, staging / "config.json")
        if config_dir.is_dir():
            copy_tokenizer_files(config_dir, staging)
        report = ConversionReport(out=out, num_tensors=len(weight_map), num_bytes=total, verified=False)
        if _should_verify(verify, total):
            _verify(staging, checkpoint, report, dtype)
    return report


def _verify(hf_dir: Path, megatron_ckpt: Path, report: ConversionReport, dtype: Optional[torch.dtype]) -> None:
    """Compare logits; with a dtype change, both sides' weights are rounded to the written dtype."""
    from dapo_megatron.ckpt.verify import TOLERANCE, compare_logits

    error = compare_logits(hf_dir, megatron_ckpt, weights_dtype=dtype)
    report.verified, report.max_logit_error = True, error
    if not error <= TOLERANCE:
        raise ConversionError(
            f"verification failed: Megatron and transformers logits differ by {error:.3g} (relative to the "
            f"largest logit; at most {TOLERANCE:g} expected, both sides' weights rounded to the same dtype) on the "
            f"same prompts; the converted checkpoint was not kept"
        )


@contextlib.contextmanager
def silenced(enabled: bool) -> Iterator[None]:
    """Python warnings, library logs below errors and transformers' loading bar off."""
    if not enabled:
        yield
        return
    import warnings

    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    disabled_below = logging.root.manager.disable
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled_below)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def run_cli(direction: str, args, log: Callable[[str], None]) -> ConversionReport:
    """Entry point used by ``dapo-megatron convert`` and ``tools/convert_ckpt``. The
    libraries' warnings (megatron's optional kernels, transformers' loading) are never
    printed into the progress lines; ``--quiet`` drops the progress lines too."""
    with silenced(True):
        report = _convert_from_args(direction, args)
    checked = (
        f"verified against transformers (max relative logit error {report.max_logit_error:.2e})"
        if report.verified
        else "not verified (pass --verify to compare logits with transformers)"
    )
    log(f"wrote {report.out}: {report.num_tensors} tensors, {report.num_bytes / 2**20:.1f} MiB; {checked}")
    return report


def _convert_from_args(direction: str, args) -> ConversionReport:
    verify = "auto" if args.verify is None else args.verify
    dtype = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    if direction == "hf-to-megatron":
        report = hf_to_megatron(
            args.hf_dir, args.out, overwrite=args.overwrite, verify=verify, dtype=dtype, progress=not args.quiet
        )
    else:
        report = megatron_to_hf(
            args.ckpt,
            args.hf_config,
            args.out,
            overwrite=args.overwrite,
            verify=verify,
            dtype=dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            progress=not args.quiet,
        )
    return report


def export_hf(checkpoint: str | Path, config, out: Path) -> None:
    """A run's Megatron checkpoint as HF safetensors, verified as ``convert`` verifies, with
    config.json from ``model.hf_config`` and the run's tokenizer files copied (the final
    policy of a run; ``eval --ckpt``). ``config`` is the run's :class:`~dapo_megatron.config.Config`."""
    if config.model.hf_config is None:
        raise ConfigError("exporting a checkpoint to HF needs model.hf_config (the model's config.json)")
    with silenced(True):  # the verification's library warnings; errors still raise
        report = megatron_to_hf(checkpoint, config.model.hf_config, out, overwrite=True, progress=False)
    tokenizer_dir = config.data.tokenizer or config.model.hf_weights_folder
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), out)
    checked = f"verified (max relative logit error {report.max_logit_error:.1e})" if report.verified else "not verified"
    logger.info("%s exported to %s (%s)", checkpoint, out, checked)
