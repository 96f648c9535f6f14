"""Peak memory and time of log-prob + entropy (forward and backward), ours vs plain log_softmax.

Run: ``.venv/bin/python benchmarks/bench_logprob.py [--tokens 2048] [--vocab 152064] [--hidden 128]``.

Each variant runs in a fresh process pinned to one core with one thread:

- ``plain``: ``logits = hidden @ W^T`` in fp32, ``log_softmax``, gather the target,
  entropy ``-sum p log p``, backward through all of it (what a straightforward actor does);
- ``chunked``: :func:`vocab_parallel_log_probs_and_entropy`, which computes the output
  layer and the log-softmax together chunk by chunk and recomputes in backward.

Both produce the same outputs and the same gradients for hidden and W. Extra peak memory
is the process's peak RSS during the operation minus its RSS just before it, reported in
units of the full fp32 logits' size (tokens x vocab x 4 bytes); it includes the gradient
buffers both variants must return (W's gradient is vocab x hidden x 4 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_variant(variant: str, tokens: int, vocab: int, hidden_size: int) -> dict:
    import torch

    from dapo_megatron.actor.vocab_parallel import vocab_parallel_log_probs_and_entropy

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.05).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    # Warm up allocator and kernels on a tiny problem so first-call costs are not timed.
    small = vocab_parallel_log_probs_and_entropy(
        hidden[:4].detach(), weight[:64].detach(), targets[:4] % 64, vocab_size=64
    )
    del small
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if variant == "plain":
        logits = hidden @ weight.t()
        log_softmax = torch.log_softmax(logits, dim=-1)
        log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    else:
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(hidden, weight, targets, vocab_size=vocab)
    (log_probs.sum() + entropy.sum()).backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "seconds": elapsed,
        "extra_peak_bytes": peak - before,
        "peak_before_op_exceeded_rss": peak_before > before + 64 * 2**20,
        "log_prob_sum": float(log_probs.sum()),
        "entropy_sum": float(entropy.sum()),
        "weight_grad_norm": float(weight.grad.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--variant", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        print(json.dumps(_run_variant(args.variant, args.tokens, args.vocab, args.hidden)))
        return
    logits_bytes = args.tokens * args.vocab * 4
    results = {}
    for variant in ("plain", "chunked"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, chunked = results["plain"], results["chunked"]
    print(f"log-prob + entropy fwd+bwd, {args.tokens} tokens x {args.vocab} vocab (hidden {args.hidden}), one core")
    print(
        f"logits size (fp32): {logits_bytes / 2**30:.2f} GiB; W gradient: {args.vocab * args.hidden * 4 / 2**20:.0f} MiB"
    )
    for name, r in results.items():
        print(
            f"  {name:8s} extra peak {r['extra_peak_bytes'] / logits_bytes:5.2f}x logits   time {r['seconds']:6.2f} s"
        )
    print(
        f"  ratio chunked/plain: memory {chunked['extra_peak_bytes'] / plain['extra_peak_bytes']:.2f}, "
        f"time {chunked['seconds'] / plain['seconds']:.2f}"
    )
    same = abs(plain["log_prob_sum"] - chunked["log_prob_sum"]) <= 1e-4 * abs(plain["log_prob_sum"])
    print(f"  same outputs: {same} (log-prob sums {plain['log_prob_sum']:.3f} / {chunked['log_prob_sum']:.3f})")


if __name__ == "__main__":
    main()
