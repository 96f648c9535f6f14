"""Rank body: a converted HF checkpoint in megatron's GPTModel at some (tp, pp); logits out."""

from __future__ import annotations

import torch

from dapo_megatron.config import config_from_dict
from dapo_megatron.runtime.distributed import megatron_runtime


def logits_at_layout(hf_dir: str, ckpt: str, out_file: str, tp_size: int, pp_size: int, tokens: torch.Tensor) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from dapo_megatron.ckpt.loading import load_megatron_weights
    from dapo_megatron.models.gpt import build_model

    cfg = config_from_dict(
        {
            "model": {"hf_config": hf_dir, "params_dtype": "float32"},
            "parallel": {
                "device": "cpu",
                "tp_size": tp_size,
                "pp_size": pp_size,
                "num_devices_per_node": tp_size * pp_size,
            },
            "rollout": {"max_prompt_length": 16, "max_response_length": 48},
            "algorithm": {"overlong_buffer_len": 8},
            "data": {"train_batch_size": 4, "mini_batch_size": 4},
            "trainer": {"micro_batch_max_tokens": 64},
        }
    )
    with megatron_runtime(cfg.parallel, seed=0) as info:
        gpt = build_model(cfg.model, cfg.parallel, "cpu", output_logits=True)
        load_megatron_weights(gpt, ckpt)
        gpt.eval()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch, positions, None)

            def loss_func(logits):
                full = gather_from_tensor_model_parallel_region(logits)
                return torch.zeros(()), torch.zeros((), dtype=torch.int), {"logits": full}

            return output, loss_func

        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([tokens]),
                model=[gpt],
                num_microbatches=1,
                seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0],
                forward_only=True,
            )
        if parallel_state.is_pipeline_last_stage() and info.tp_rank == 0:
            torch.save(outputs[0]["logits"][..., : cfg.model.vocab_size], out_file)
