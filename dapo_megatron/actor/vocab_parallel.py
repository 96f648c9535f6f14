"""Log-probs and entropy straight from hidden states, never holding full-vocabulary logits.

For a 152k vocabulary and 20k-token responses the logits of one sequence are 12 GB in
fp32; a plain ``log_softmax`` holds several copies of them at once (the measured anchor:
4x their size of extra peak memory). Here the output layer and the log-softmax are one
operation, done chunk by chunk along the sequence:

- forward, per chunk of tokens: logits of this rank's vocabulary shard (``hidden @ W^T``),
  their max all-reduced (MAX) over the tensor-parallel group, then sum-exp, sum of
  ``exp * logit`` and the target logit (taken on the rank that owns the target id) in one
  all-reduce (SUM). That gives ``log p(target) = z_t - logsumexp`` and the entropy
  ``logsumexp - sum p z``. Only two floats per token are kept.
- backward recomputes each chunk's logits and forms the gradient of both outputs with
  respect to the logits analytically, then to the hidden states and the weight.

Vocabulary padding (megatron pads to a multiple of ``divisor * tp``) is masked to -inf,
so padded ids never receive probability. The hidden-state gradient is a partial sum over
this rank's vocabulary shard; the caller's tensor-parallel mapping (megatron's
``copy_to_tensor_model_parallel_region`` or the sequence-parallel gather) sums it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 128 * 2**20
"""Budget for one chunk's fp32 logits; a few such buffers are alive at once."""


def chunk_tokens_for(vocab_shard_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits stay within ``chunk_bytes``."""
    return max(16, min(8192, chunk_bytes // (4 * max(vocab_shard_size, 1))))


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, inv_temperature: float, out: torch.Tensor
) -> torch.Tensor:
    """fp32 logits of one chunk on this shard's real (unpadded) vocabulary rows, into ``out``. [c, v]

    With bf16 weights the GEMM's result is fp32 (its fp32 accumulator kept), not a bf16
    result cast afterwards: rounding logits of magnitude 20 to bf16 moves them by up to
    0.06, which the log-prob inherits and the engine's (fp32-logit) sampler does not. On
    CUDA one GEMM with an fp32 output (``out_dtype``); on the CPU (tests), the inputs are
    cast to fp32, which gives the same products exactly.
    """
    out = out[: hidden.shape[0]]
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        torch.matmul(hidden, weight.t(), out=out)
    elif hidden.is_cuda:
        torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    else:
        torch.matmul(hidden.float(), weight.float().t(), out=out)
    if inv_temperature != 1.0:
        out.mul_(inv_temperature)
    return out


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Two chunk-sized fp32 buffers are allocated per call and reused for every chunk, so
    the extra memory is ``2 * chunk * vocab_shard * 4`` bytes whatever the sequence length."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, valid_size, inv_temperature, chunk, group):
        num_tokens = hidden.shape[0]
        device = hidden.device
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=device)
        entropy = torch.empty_like(log_probs)
        logsumexp = torch.empty_like(log_probs)
        real_weight = weight[:valid_size]  # padded vocabulary rows never enter the softmax
        width = max(valid_size, 1)
        shifted_buf = torch.empty(min(chunk, num_tokens), width, dtype=torch.float32, device=device)
        exp_buf = torch.empty_like(shifted_buf)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            rows = end - start
            stats = torch.zeros(rows, 3, dtype=torch.float32, device=device)  # [sum e, sum e*z, z_target]
            if valid_size > 0:
                shifted = _chunk_logits(hidden[start:end], real_weight, inv_temperature, shifted_buf)  # [c, v]
                row_max = shifted.max(dim=-1).values  # [c]
            else:
                row_max = torch.full((rows,), float("-inf"), device=device)
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            if valid_size > 0:
                shifted.sub_(row_max.unsqueeze(-1))  # z - m
                local_target = targets[start:end] - vocab_start
                owned = (local_target >= 0) & (local_target < valid_size)
                index = local_target.clamp(0, valid_size - 1).unsqueeze(-1)
                stats[:, 2] = torch.where(owned, shifted.gather(-1, index).squeeze(-1), 0.0)
                exps = torch.exp(shifted, out=exp_buf[:rows])
                stats[:, 0] = exps.sum(dim=-1)
                stats[:, 1] = exps.mul_(shifted).sum(dim=-1)
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            log_sum = torch.log(stats[:, 0])
            logsumexp[start:end] = row_max + log_sum
            log_probs[start:end] = stats[:, 2] - log_sum
            # H = logsumexp - E[z] = log S - E[z - m]
            entropy[start:end] = log_sum - stats[:, 1] / stats[:, 0]
        ctx.save_for_backward(hidden, weight, targets, logsumexp, entropy)
        ctx.settings = (vocab_start, valid_size, inv_temperature, chunk)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, logsumexp, entropy = ctx.saved_tensors
        vocab_start, valid_size, inv_temperature, chunk = ctx.settings
        num_tokens = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        if valid_size == 0 or (grad_log_probs is None and grad_entropy is None):
            return grad_hidden, _cast(grad_weight, weight), None, None, None, None, None, None
        real_weight = weight[:valid_size]
        logit_buf = torch.empty(min(chunk, num_tokens), valid_size, dtype=torch.float32, device=hidden.device)
        prob_buf = torch.empty_like(logit_buf)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            rows = end - start
            log_p = _chunk_logits(hidden[start:end], real_weight, inv_temperature, logit_buf)
            log_p.sub_(logsumexp[start:end].unsqueeze(-1))  # log softmax, in place
            probs = torch.exp(log_p, out=prob_buf[:rows])
            # d log p_t / dz = onehot_t - p ;  d H / dz = -p (log p + H), so together
            # grad_z = -p * ((log p + H) * g_H + g_lp) + onehot_t * g_lp.
            grad = log_p  # reuse the buffer
            if grad_entropy is not None:
                grad.add_(entropy[start:end].unsqueeze(-1)).mul_(grad_entropy[start:end].unsqueeze(-1))
            else:
                grad.zero_()
            g_lp = grad_log_probs[start:end] if grad_log_probs is not None else None
            if g_lp is not None:
                grad.add_(g_lp.unsqueeze(-1))
            grad.mul_(probs).neg_()
            if g_lp is not None:
                local_target = targets[start:end] - vocab_start
                owned = torch.nonzero((local_target >= 0) & (local_target < valid_size)).squeeze(-1)
                grad[owned, local_target[owned]] += g_lp[owned]
            if inv_temperature != 1.0:
                grad.mul_(inv_temperature)
            grad_in = grad if hidden.dtype == torch.float32 else grad.to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_in, real_weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if grad_in.dtype == torch.float32:
                    grad_weight[:valid_size].addmm_(grad_in.t(), hidden[start:end])
                else:
                    grad_weight[:valid_size].add_(torch.matmul(grad_in.t(), hidden[start:end]).float())
        return grad_hidden, _cast(grad_weight, weight), None, None, None, None, None, None


def _cast(grad_weight: Optional[torch.Tensor], weight: torch.Tensor) -> Optional[torch.Tensor]:
    return grad_weight if grad_weight is None else grad_weight.to(weight.dtype)


def vocab_parallel_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    temperature: float = 1.0,
    group: Optional[dist.ProcessGroup] = None,
    chunk_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy of the next-token distribution.

    Args:
        hidden: ``[num_tokens, hidden]`` final hidden states (already through the
            tensor-parallel input mapping of the output layer).
        weight: ``[vocab_shard, hidden]`` this rank's rows of the output layer.
        targets: ``[num_tokens]`` token ids (global vocabulary ids).
        vocab_size: the real vocabulary size; ids at or above it are padding and get no
            probability.
        vocab_start: first global id of this rank's shard.
        temperature: logits are divided by it (the sampling temperature).
        group: tensor-parallel process group the vocabulary is split over (None: unsplit).
        chunk_tokens: tokens per chunk; default keeps one chunk's logits near 128 MiB.

    Returns:
        ``(log_probs, entropy)``, both fp32 ``[num_tokens]``, both differentiable.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"hidden must be [tokens, hidden], weight [vocab_shard, hidden], targets [tokens]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    valid_size = max(0, min(weight.shape[0], vocab_size - vocab_start))
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    return _VocabParallelLogProbEntropy.apply(
        hidden, weight, targets.long(), vocab_start, valid_size, 1.0 / temperature, chunk, group
    )
