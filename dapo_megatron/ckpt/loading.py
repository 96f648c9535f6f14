"""Load model weights from a megatron dist checkpoint into a GPTModel of any layout.

megatron's own ``dist_checkpointing.load`` does the resharding; this adds what a
checkpoint converted from HF (or written at another tensor-parallel size) needs: the
``_extra_state`` entries (Transformer Engine's fp8 bookkeeping, no weights) are not
requested, and the vocabulary-sized tensors load with a shape mismatch allowed (megatron
marks them so), zero-filling this layout's padding rows.
"""

from __future__ import annotations

import os


def _drop_extra_state(sharded: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        key: value
        for key, value in sharded.items()
        if not (isinstance(value, ShardedObject) and key.endswith("_extra_state"))
    }


def load_megatron_weights(gpt, path: str | os.PathLike) -> None:
    """Load ``gpt``'s parameters (this rank's shards) from the dist checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    sharded = _drop_extra_state(gpt.sharded_state_dict(prefix=""))
    loaded = dist_checkpointing.load(sharded, str(path))
    missing, unexpected = gpt.load_state_dict(loaded, strict=False)
    missing = [key for key in missing if not key.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} did not fill the model: missing {missing}, unexpected {unexpected}")
