"""A Hugging Face safetensors checkpoint, read lazily tensor by tensor, and checked
against the shape its config.json implies.

Its own module because both directions use it: the converter (:mod:`convert`) and the
loading of HF weights straight into a running actor (:mod:`loading`), which the
converter's verification (:mod:`verify`) also uses; in :mod:`convert` it closed an
import circle convert -> verify -> loading -> convert.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dapo_megatron.ckpt.mapping import ModelShape, hf_shapes
from dapo_megatron.config import ConfigError

IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
"""HF tensors that are buffers, not weights (older checkpoints store RoPE's inverse
frequencies); they are neither converted nor expected."""


class ConversionError(ConfigError):
    """The inputs cannot be converted; the message names what is wrong and what to do."""


class HFCheckpoint:
    """A Hugging Face safetensors checkpoint, read lazily tensor by tensor."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").exists():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise ConversionError(f"{self.dir} has no model.safetensors or model.safetensors.index.json")
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name in files:
            path = self.dir / name
            if not path.exists():
                raise ConversionError(f"{index} lists {name}, which is missing from {self.dir}")
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor_slice = f.get_slice(key)
                    self.file_of[key] = path
                    self.shapes[key] = tuple(tensor_slice.get_shape())
                    self.dtypes[key] = tensor_slice.get_dtype()
        if weight_map is not None:
            unlisted = sorted(set(self.file_of) - set(weight_map))
            if unlisted:
                raise ConversionError(f"{index} does not list tensors found in the shards: {', '.join(unlisted[:10])}")

    def read(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its memory-mapped file (which is closed again)."""
        from safetensors import safe_open

        with safe_open(str(self.file_of[name]), framework="pt") as f:
            return f.get_tensor(name).clone()

    def check_against(self, shape: ModelShape) -> None:
        """Refuse missing, extra and mis-shaped tensors, naming them."""
        expected = hf_shapes(shape)
        found = {k: v for k, v in self.shapes.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        if missing:
            hint = ""
            if missing == ["lm_head.weight"]:
                hint = " (config.json says tie_word_embeddings=false; a tied model has no lm_head)"
            raise ConversionError(f"{self.dir}: missing tensors: {', '.join(missing[:10])}{hint}")
        if extra:
            hint = ""
            if extra == ["lm_head.weight"]:
                hint = " (config.json says tie_word_embeddings=true, but the checkpoint has its own lm_head)"
            raise ConversionError(f"{self.dir}: unexpected tensors: {', '.join(extra[:10])}{hint}")
        for name, want in expected.items():
            if tuple(found[name]) != tuple(want):
                raise ConversionError(
                    f"{self.dir}: tensor {name} has shape {tuple(found[name])}, but config.json implies {tuple(want)}; "
                    "the config and the checkpoint disagree"
                )
