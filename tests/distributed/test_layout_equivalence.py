"""The CPU runtime runs megatron's real code, and its result does not depend on the layout.

The same tiny GPTModel weights (one megatron dist checkpoint) are loaded at
(tp, pp) = (1, 1) on one rank and (2, 2) on four gloo ranks; one forward-backward through
megatron's pipeline schedule and one distributed-optimizer step later, the loss, the grad
norm and every updated weight must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dapo_megatron.runtime.launch import launch_local
from tests.distributed import layout_worker


def _full_weights(checkpoint_dir, tmp_path, name):
    """Global (unsharded) tensors of a megatron torch_dist checkpoint, read without ranks."""
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _result(tmp_path, tp, pp):
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"result_tp{tp}_pp{pp}_rank*.json"))]
    assert results, f"no last-stage result for tp={tp} pp={pp}"
    # Every last-stage rank (one per tp rank) reports the same numbers.
    for other in results[1:]:
        assert other["loss"] == results[0]["loss"]
        assert other["grad_norm"] == results[0]["grad_norm"]
    return results[0]


@pytest.mark.timeout(300)
def test_tp2_pp2_matches_single_rank(tmp_path, with_initial):
    with_initial(tmp_path)
    launch_local(layout_worker.train_one_step, 1, (str(tmp_path), 1, 1))
    launch_local(layout_worker.train_one_step, 4, (str(tmp_path), 2, 2))

    single, split = _result(tmp_path, 1, 1), _result(tmp_path, 2, 2)
    assert split["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert split["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    # The batch is random tokens: the loss is near log(vocab) and gradients are not tiny.
    assert single["loss"] > 1.0 and single["grad_norm"] > 0.1

    initial = _full_weights(tmp_path / "init", tmp_path, "init")
    after_single = _full_weights(tmp_path / "post_tp1_pp1", tmp_path, "single")
    after_split = _full_weights(tmp_path / "post_tp2_pp2", tmp_path, "split")
    assert initial.keys() == after_single.keys() == after_split.keys()
    assert "output_layer.weight" in initial and "decoder.layers.self_attention.linear_qkv.weight" in initial
    for name, before in initial.items():
        a, b = after_single[name], after_split[name]
        assert a.shape == b.shape == before.shape, name
        scale = a.abs().max().item()
        tolerance = 1e-5 * scale
        moved = (a - before).abs().max().item()
        # The step moved every tensor far more than the tolerance, so agreement means something.
        assert moved > 100 * tolerance, f"{name}: step moved weights by only {moved}"
        diff = (a - b).abs().max().item()
        assert diff <= tolerance, f"{name}: tp2/pp2 differs from tp1/pp1 by {diff} (scale {scale})"
