"""Rank bodies for the layout-equivalence test: a tiny megatron GPTModel trained one step.

Each function runs inside a rank launched by :func:`launch_local`; results go to files
in a work folder that the test process reads afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dapo_megatron.config import config_from_dict
from dapo_megatron.runtime.distributed import megatron_runtime

MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 2
SEQ_LEN = 16
# Adam's first step is lr * g / (|g| + eps). With the usual eps=1e-8 it is a sign function
# of near-zero gradients, so fp32 rounding (~1e-9) in a gradient flips whole updates; a
# larger eps keeps the update a smooth function of the gradient, so comparing updated
# weights across layouts measures the gradients, not the rounding.
ADAM_EPS = 1e-3


def tiny_config(tp_size: int, pp_size: int, dp_size: int = 1, vocab_size: int = 128):
    return config_from_dict(
        {
            "model": {
                "num_layers": 4,
                "hidden_size": 64,
                "ffn_hidden_size": 128,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                # 128 is a multiple of make_vocab_size_divisible_by * tp for tp in {1, 2}: no
                # padding, so the checkpoint has the same shapes in every layout.
                "vocab_size": vocab_size,
                "make_vocab_size_divisible_by": 8,
                "max_position_embeddings": 64,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
            },
            "parallel": {
                "device": "cpu",
                "tp_size": tp_size,
                "pp_size": pp_size,
                "num_devices_per_node": tp_size * pp_size * dp_size,
            },
            "rollout": {"max_prompt_length": 16, "max_response_length": 48},
            "algorithm": {"overlong_buffer_len": 8},
            "data": {"train_batch_size": 4, "mini_batch_size": 4, "gen_batch_size": 4},
            "trainer": {"micro_batch_max_tokens": 64},
        },
        source="tiny test config",
    )


def _batch() -> list[dict[str, torch.Tensor]]:
    """The same micro-batches on every rank (fixed generator)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (NUM_MICROBATCHES, MICRO_BATCH_SIZE, SEQ_LEN + 1), generator=gen)
    mask = (torch.rand((NUM_MICROBATCHES, MICRO_BATCH_SIZE, SEQ_LEN), generator=gen) > 0.3).float()
    position_ids = torch.arange(SEQ_LEN).expand(MICRO_BATCH_SIZE, SEQ_LEN)
    return [
        {"tokens": tokens[i, :, :-1], "labels": tokens[i, :, 1:], "loss_mask": mask[i], "position_ids": position_ids}
        for i in range(NUM_MICROBATCHES)
    ]


def _build(cfg):
    from dapo_megatron.models.gpt import build_model

    return build_model(cfg.model, cfg.parallel, "cpu")


def _sharded(model):
    return model.sharded_state_dict(prefix="")


def _save(model, path: str) -> None:
    from dapo_megatron.actor.checkpoint import save_dist_checkpoint

    os.makedirs(path, exist_ok=True)
    save_dist_checkpoint(_sharded(model), path)


def save_initial(workdir: str, vocab_size: int = 128) -> None:
    """One rank: random tiny model, saved as a megatron dist checkpoint."""
    cfg = tiny_config(1, 1, vocab_size=vocab_size)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed):
        model = _build(cfg)
        _save(model, os.path.join(workdir, "init"))


def train_one_step(workdir: str, tp_size: int, pp_size: int) -> None:
    """Load the initial checkpoint into (tp, pp), take one step, save weights and numbers."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = tiny_config(tp_size, pp_size)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        model = _build(cfg)
        state = dist_checkpointing.load(_sharded(model), os.path.join(workdir, "init"))
        model.load_state_dict(state)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        ddp_model = DistributedDataParallel(model.config, ddp_config, model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-2,
                weight_decay=0.01,
                clip_grad=1.0,
                adam_eps=ADAM_EPS,
                use_distributed_optimizer=True,
            ),
            [ddp_model],
        )
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.grad_scale_func = optimizer.scale_loss

        def forward_step(data_iterator, gpt):
            micro = next(data_iterator)
            per_token = gpt(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])

            def loss_func(output):
                if output is None:
                    raise AssertionError("last stage produced no loss")
                loss = (output.float() * micro["loss_mask"]).sum() / micro["loss_mask"].sum()
                return loss, {"lm loss": loss.detach()}

            return per_token, loss_func

        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(_batch()),
            model=[ddp_model],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ_LEN,
            micro_batch_size=MICRO_BATCH_SIZE,
            forward_only=False,
        )
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise AssertionError("optimizer step was skipped")
        _save(model, os.path.join(workdir, f"post_tp{tp_size}_pp{pp_size}"))
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([d["lm loss"] for d in losses]).mean().item()
            result = {"loss": loss, "grad_norm": float(grad_norm), "rank": info.rank}
            Path(workdir, f"result_tp{tp_size}_pp{pp_size}_rank{info.rank}.json").write_text(json.dumps(result))
