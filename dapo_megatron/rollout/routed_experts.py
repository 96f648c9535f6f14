"""The experts an engine routed each token to: recorded while it samples, replayed by the actor.

A mixture-of-experts model picks each token's top-k experts per MoE layer from its
router's scores. Two implementations of the same weights (the engine's kernels in bf16,
the actor's in fp32 routing) pick differently for the tokens whose k-th and (k+1)-th
scores are close, and a token sent to another expert gets another log-prob: the largest
part of the train-inference mismatch of MoE RL. Rollout routing replay (R3) removes it:
the engine returns what it picked, and the actor's routers take those experts instead of
their own top-k (their probabilities stay the actor's own softmax over the replayed
experts, so gradients still reach the router).

The record of one sequence is a numpy array ``[positions, moe_layers, k]`` of expert ids
(``uint8`` up to 256 experts, ``int16`` beyond: Qwen3-30B-A3B's 48 layers x top 8 cost 384
bytes a token; numpy, not torch, because records cross between processes by the hundred
and a small torch tensor pickles about 45 times slower than an array), where position ``p`` is the input token ``p`` of prompt +
response and the entry is what routed it when the engine computed the distribution of
token ``p + 1``. It covers a prefix: every position up to the one before the last token
(the engine never feeds the last sampled token back). A response continued after an
abort, or a multi-turn episode's next turn, keeps the record of what it held and appends
only the positions it had not routed yet (:func:`extended`), so every sampled token's
routing is the one its sampling used, whichever weights were serving then.

This module is the format and the transformers engine's recorder; SGLang returns the
same record from its ``routed_experts`` capture (``rollout/sglang_engine.py``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds an expert id of ``num_experts``."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16)


def bytes_per_token(num_experts: int, moe_layers: int, topk: int) -> int:
    """Host memory of one token's routing record."""
    return moe_layers * topk * (1 if num_experts <= 256 else 2)


def extended(held: Optional[np.ndarray], new: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """``held``'s positions, then ``new``'s beyond them (``new`` covers the same sequence
    from position 0: a request's prompt and what it sampled)."""
    if new is None:
        return held
    if held is None or len(held) == 0:
        return new
    return np.concatenate([held, new[len(held) :]]) if len(new) > len(held) else held


def cut(routing: Optional[np.ndarray], positions: int) -> Optional[np.ndarray]:
    """The first ``positions`` positions (a response cut back to fewer tokens)."""
    return None if routing is None else routing[: max(positions, 0)]


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """A transformers model's routers (``mlp.gate`` of each MoE layer, as the family
    records say), with each one's MoE-layer ordinal, in layer order."""
    routers = []
    for index, layer in enumerate(getattr(model.model, "layers", [])):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            routers.append((index, gate))
    return [(ordinal, gate) for ordinal, (_, gate) in enumerate(routers)]


class RoutingRecorder:
    """Forward hooks on a transformers MoE model's routers that keep the expert ids of
    every call, for the rows of one ``generate``: the prefill call holds every input
    column, each decoding call one more column.

    Use as a context manager; :meth:`rows` then gives each row's record."""

    def __init__(self, model, num_rows: int) -> None:
        self.routers = moe_routers(model)
        self.num_rows = num_rows
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.dtype = routing_dtype(int(self.routers[0][1].num_experts)) if self.routers else np.dtype(np.uint8)
        self._handles = []

    def __enter__(self) -> RoutingRecorder:
        for ordinal, gate in self.routers:
            self._handles.append(gate.register_forward_hook(self._hook(ordinal)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, ordinal: int):
        def hook(module, inputs, outputs) -> None:
            indices = outputs[2]  # (router logits, top-k weights, top-k expert ids)
            self.calls[ordinal].append(indices.detach().reshape(self.num_rows, -1, indices.shape[-1]).cpu())

        return hook

    def columns(self) -> Optional[np.ndarray]:
        """``[rows, columns, moe_layers, k]``: every input column the calls routed."""
        if not self.routers or not self.calls[0]:
            return None
        per_layer = [torch.cat(calls, dim=1) for calls in self.calls]
        return torch.stack(per_layer, dim=2).numpy().astype(self.dtype)

    def rows(self, prompt_lengths: list[int], width: int, response_lengths: list[int]) -> list[Optional[np.ndarray]]:
        """Each row's record (left-padded prompts ending at column ``width``): its prompt's
        positions and those of its response but the last token."""
        columns = self.columns()
        if columns is None:
            return [None] * len(prompt_lengths)
        out = []
        for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
            out.append(columns[row, width - prompt : width + max(response, 1) - 1].copy())
        return out
