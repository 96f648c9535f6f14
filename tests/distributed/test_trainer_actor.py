"""What the trainer needs of the actor: the sampling temperature in the ratio, and
initial weights straight from an HF folder."""

from __future__ import annotations

import json

import pytest
import torch

from dapo_megatron.ckpt.convert import hf_to_megatron
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import trainer_worker
from tests.distributed.actor_worker import tiny_hf_qwen2


def test_first_update_ratio_is_one_at_the_sampling_temperature(tmp_path, with_initial):
    with_initial(tmp_path)
    launch_local(trainer_worker.ratio_at_temperature, 2, (str(tmp_path), 2, 0.7))
    results = json.loads((tmp_path / "temperature_tp2.json").read_text())
    same = results["same"]
    assert abs(same["ratio_mean"] - 1) <= 1e-6 and abs(same["ratio_max"] - 1) <= 1e-6
    assert abs(same["approx_kl"]) <= 1e-12 and same["pg_clipfrac_low"] == 0
    # Negative control: training at temperature 1 against old log-probs at 0.7 is off-policy.
    assert abs(results["control_t1"]["ratio_max"] - 1) > 1e-2
    assert results["control_t1"]["approx_kl"] > 1e-4


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weights_straight_from_hf_equal_the_converted_checkpoint(tmp_path, tp_size):
    tiny_hf_qwen2(tied=False, seed=0).save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "converted", verify=False, progress=False)
    launch_local(trainer_worker.hf_against_converted, tp_size, (str(tmp_path), tp_size))
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"hf_load_tp{tp_size}_rank*.json"))]
    assert len(reports) == tp_size
    for report in reports:
        assert report["num_params"] >= 4 * 6 + 3
        assert report["unequal"] == []
        assert report["log_prob_max_diff"] == 0.0 and report["log_prob_min"] < -1.0


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 1)])
def test_tied_weights_straight_from_hf_match_transformers(tmp_path, tp_size, pp_size):
    """Tied embeddings: at pp > 1 the last stage's output layer is a copy of the embedding."""
    model = tiny_hf_qwen2(tied=True, seed=1).eval()
    model.save_pretrained(tmp_path / "hf_tied")
    launch_local(trainer_worker.hf_log_probs, tp_size * pp_size, (str(tmp_path), tp_size, pp_size))
    result = torch.load(tmp_path / f"hf_tied_tp{tp_size}_pp{pp_size}.pt")
    with torch.no_grad():
        logits = model(input_ids=result["tokens"]).logits.double()  # [batch, seq, vocab]
    reference = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, result["tokens"][:, 1:, None]).squeeze(-1)
    mask = result["mask"][:, 1:].bool()
    diff = (result["log_probs"][:, 1:].double() - reference)[mask].abs().max().item()
    assert mask.sum() > 10 and diff < 1e-4, diff


def test_a_mini_batch_without_loss_tokens_is_skipped_and_bad_ids_refused(tmp_path, with_initial):
    with_initial(tmp_path)
    launch_local(trainer_worker.empty_mini_batch, 2, (str(tmp_path),))
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("empty_rank*.json"))]
    assert len(reports) == 2
    for report in reports:
        assert report["empty"] == [0.0, 1.0] and report["steps"] == 1
        assert report["unequal"] == [] and report["loss"][0] == report["loss"][1] != 0
        assert report["state_kept"]
    # Every rank refuses together: the one holding the id names it, the other says where it is.
    refusals = sorted(report["refused"] for report in reports)
    assert "1 response token id(s) on another data-parallel rank are outside the vocabulary of 128" in refusals[0]
    assert "token id 10000 is a response token but the vocabulary has 128 ids" in refusals[1]


def test_a_nonfinite_update_is_skipped_on_every_rank(tmp_path, with_initial):
    with_initial(tmp_path)
    launch_local(trainer_worker.nonfinite_update, 2, (str(tmp_path),))
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("nonfinite_rank*.json"))]
    assert len(reports) == 2
    for report in reports:
        # The infinite weight is on rank 1 only; rank 0's own loss is finite, and it skips too.
        assert report["bad"] == {"nonfinite": 1.0, "update_skipped": 1.0} and report["unchanged"]
        assert not report["bad_loss_finite"]
        assert report["good"] == {"nonfinite": 0.0, "update_skipped": 0.0} and report["moved"] > 10


def test_a_failing_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, with_initial):
    with_initial(tmp_path)
    launch_local(trainer_worker.failing_checkpoint_write, 2, (str(tmp_path),))
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("failing_write_rank*.json"))]
    assert len(reports) == 2
    for report in reports:
        assert "writing the checkpoint of step 2" in report["error"]
        assert f"the latest checkpoint is still {tmp_path / 'saves' / report['first']}" in report["error"]
        assert report["entries"] == ["latest", report["first"]]  # the failed save left nothing
        assert report["restored_step"] == 1 and report["restored"]
        assert report["children_after_save"] == []  # megatron's results Manager was not spawned
    assert "No space left on device" in reports[0]["error"]
