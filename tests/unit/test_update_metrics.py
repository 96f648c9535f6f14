"""The update's metrics as one type: an update's means from its token sums, and a step's
updates merged into the step's ``actor/*`` and ``moe/*`` metrics, against numbers
computed by hand."""

from __future__ import annotations

import math

import pytest

from dapo_megatron.actor.update_metrics import LOSS_MEANS, TOKEN_SUMS, UpdateMetrics


def _update(tokens: float, value: float, **fields) -> UpdateMetrics:
    """An update of ``tokens`` loss tokens whose every token mean is ``value``."""
    sums = [value if name == "loss" else tokens if name == "tokens" else value * tokens for name in TOKEN_SUMS]
    kwargs = dict(grad_norm=1.0, stepped=True, finite=True, lr=1e-3, num_micro_batches=2, routing={})
    kwargs.update(fields)
    return UpdateMetrics.from_sums(sums, 2.0 * value, **kwargs)


def test_an_update_s_means_are_its_token_sums_over_its_tokens():
    update = _update(4.0, 0.25)
    assert update.loss == 0.25 and update.tokens == 4.0 and update.ratio_max == 0.5
    assert all(getattr(update, name) == 0.25 for name in ("entropy", "mean_prob", *LOSS_MEANS))
    assert update.update_skipped == 0.0 and update.nonfinite == 0.0 and update.num_micro_batches == 2.0
    skipped = _update(4.0, 0.25, stepped=False, finite=False)
    assert skipped.update_skipped == 1.0 and skipped.nonfinite == 1.0


def test_a_step_s_updates_merge_token_weighted_and_empty_ones_are_only_counted():
    first, second = _update(1.0, 1.0, lr=1e-3), _update(3.0, 3.0, lr=2e-3, grad_norm=3.0)
    empty = UpdateMetrics.empty_update(lr=3e-3)
    for update in (first, second, empty):
        update.padding_share, update.padding_share_unpacked = 0.1, 0.4
    merged = UpdateMetrics.merge([first, empty, second])
    # Token-weighted: (1 x 1 + 3 x 3) / 4 = 2.5; the loss (already a global token mean) by update.
    assert merged["actor/entropy"] == merged["actor/ratio_mean"] == merged["actor/kl_loss"] == 2.5
    assert merged["actor/loss"] == 2.0 and merged["actor/grad_norm"] == 2.0
    assert merged["actor/ratio_max"] == 6.0 and merged["actor/first_update_ratio_max"] == 2.0
    assert merged["actor/lr"] == 2e-3  # the last update made, not the empty one's
    assert merged["actor/num_updates"] == 2.0 and merged["actor/empty_mini_batches"] == 1.0
    assert merged["actor/tokens"] == 4.0 and merged["actor/padding_share_unpacked"] == 0.4
    assert not any(name.startswith("moe/") for name in merged)
    # A step of empty mini-batches only: reported as such, nothing made.
    only_empty = UpdateMetrics.merge([empty])
    assert only_empty["actor/empty_mini_batches"] == 1.0 and math.isnan(only_empty["actor/grad_norm"])


def test_routing_reports_the_later_updates_change_and_the_mean_load():
    routing = [
        {"moe_tokens_per_expert_max_over_mean": 1.2, "moe_tokens_per_expert_max_over_mean_worst_layer": 1.5},
        {
            "moe_tokens_per_expert_max_over_mean": 1.4,
            "moe_tokens_per_expert_max_over_mean_worst_layer": 1.9,
            "moe_routing_changed": 0.1,
        },
        {
            "moe_tokens_per_expert_max_over_mean": 1.6,
            "moe_tokens_per_expert_max_over_mean_worst_layer": 1.7,
            "moe_routing_changed": 0.3,
        },
    ]
    merged = UpdateMetrics.merge([_update(1.0, 1.0, routing=r) for r in routing])
    assert merged["moe/tokens_per_expert_max_over_mean"] == pytest.approx(1.4)
    assert merged["moe/tokens_per_expert_max_over_mean_worst_layer"] == 1.9
    assert merged["moe/routing_changed"] == pytest.approx(0.2) and merged["moe/routing_changed_max"] == 0.3
    assert "moe/load_balancing_loss" not in merged
    # as_dict: the fields and the routing figures by name (what the tests' workers save).
    flat = _update(1.0, 1.0, routing=routing[1]).as_dict()
    assert flat["moe_routing_changed"] == 0.1 and flat["loss"] == 1.0 and "routing" not in flat
