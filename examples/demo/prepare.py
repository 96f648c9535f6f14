"""Prepare the embedded demo: a tokenizer, a task in the DAPO-Math schema, and a base model.

Real DAPO runs start from a pretrained model that already writes answers in the expected
form but is often wrong. The demo makes one in seconds on a CPU:

- **Task**: single-digit addition, ``a+b=`` for a, b in 0..9 (100 problems), written as
  DAPO-Math rows (``prompt`` chat messages, ``reward_model.ground_truth``, ``data_source``).
  A response is ``Answer: N`` and is graded by the real ``dapo_math`` reward.
- **Tokenizer**: a 16-token Hugging Face tokenizer (digits, ``+``, ``=``, ``Answer: ``,
  newline, EOS, PAD), saved with ``transformers`` so the trainer loads it like any other.
- **Base model**: a tiny Qwen2 (3 layers, hidden 128, 4 heads, 2 KV heads, tied
  embeddings; its architecture is ``model_config.json`` next to this file), or with
  ``--model-config model_config_moe.json`` a tiny Qwen3-MoE (3 layers of 4 experts, top 2),
  supervised the
  way a pretrained model comes to RL: it has the answer format and a rule that is mostly
  right, ``(a+b) mod 10`` (right exactly when there is no carry, 55 of the 100 problems),
  and it has seen the carried sum now and then (in ``carry_share`` of the carry examples),
  so that sampling sometimes writes it. Greedy, it follows its rule; DAPO has to find, from
  the reward alone, which of its own samples are right and make them its answer.

Everything is seeded; running it twice gives the same files. Usage:
``python examples/demo/prepare.py OUT_DIR`` (``make demo`` uses ``runs/demo``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

VOCAB = ["<pad>", "<eos>", *[str(d) for d in range(10)], "+", "=", "Answer: ", "\n"]
MODEL_CONFIG = Path(__file__).with_name("model_config.json")
"""The base model's architecture, committed so that demo.yaml names it before this runs
(``model_config_moe.json``: the Qwen3-MoE one of ``demo_moe.yaml``, ``--model-config``)."""
RECIPE = {
    "model": json.loads(MODEL_CONFIG.read_text()),
    "sft_steps": 1000,
    "sft_batch": 64,
    "sft_lr": 2e-3,
    "sft_warmup_steps": 50,
    "carry_share": 0.15,
    "seed": 0,
}
"""The supervised warm-up: AdamW at ``sft_lr`` with a linear warm-up over
``sft_warmup_steps`` and a linear decay to 0; a carry example is answered with its true
sum with probability ``carry_share``, with ``(a+b) mod 10`` otherwise."""
CARRY_SAMPLES = 32
"""Samples per carry problem (temperature 1) for the base model's report."""


def build_tokenizer(out: Path, vocab: list[str] = VOCAB, pattern: str = r"Answer: |\d|\+|=|\n"):
    """The demo's tokenizer (one token per item of ``vocab``, text split by the regular
    expression ``pattern``), saved to ``out`` and returned."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tokenizer.save_pretrained(out)
    return tokenizer


def write_task(data_dir: Path) -> None:
    """All 100 problems as DAPO-Math rows: the training file and the validation file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "data_source": "demo_addition",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        }
        for a in range(10)
        for b in range(10)
    ]
    for name in ("train.jsonl", "val.jsonl"):
        (data_dir / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def warm_up(out: Path, tokenizer, model_config: Path = MODEL_CONFIG):
    """The supervised warm-up of a model of architecture ``model_config`` (any family
    transformers knows); saves the model to ``out`` and returns it."""
    torch.manual_seed(RECIPE["seed"])
    rng = random.Random(RECIPE["seed"])
    model = new_model(model_config, tokenizer, len(VOCAB))

    # Each of the 100 prompts and 19 answers tokenised once (64,000 examples ask for them).
    prompts = {
        (a, b): tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a in range(10) for b in range(10)
    }
    responses = [
        tokenizer(f"Answer: {answer}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for answer in range(19)
    ]

    def example() -> tuple[list[int], list[int], list[int]]:
        a, b = rng.randrange(10), rng.randrange(10)
        carried = a + b >= 10 and rng.random() < RECIPE["carry_share"]
        response = responses[a + b if carried else (a + b) % 10]
        return prompts[(a, b)], response, response

    supervise(model, example, RECIPE, tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return model


def new_model(model_config: Path, tokenizer, vocab_size: int):
    """A freshly initialised model of architecture ``model_config``, checked against the
    tokenizer (vocabulary size, EOS and PAD ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(model_config.read_text()))
    if (config.vocab_size, config.eos_token_id, config.pad_token_id) != (
        vocab_size,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ):
        raise SystemExit(f"{model_config} disagrees with the demo tokenizer (vocabulary, EOS or PAD id)")
    return AutoModelForCausalLM.from_config(config)


def supervise(model, example, recipe: dict, pad_id: int) -> None:
    """``recipe["sft_steps"]`` steps of supervised learning on batches of
    ``recipe["sft_batch"]`` examples, each ``example()``: prompt ids, response ids, and the
    response's labels (-100 where a token is not learned). AdamW at ``recipe["sft_lr"]``,
    a linear warm-up over ``recipe["sft_warmup_steps"]`` and a linear decay to 0; the model
    is left in eval mode."""
    steps, warmup = recipe["sft_steps"], recipe["sft_warmup_steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["sft_lr"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) * (1 - i / steps))
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(recipe["sft_batch"])]
        width = max(len(p) + len(r) for p, r, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id)
        labels = torch.full((len(batch), width), -100)  # learn the response only
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, response, learned) in enumerate(batch):
            end = len(prompt) + len(response)
            input_ids[row, :end] = torch.tensor(prompt + response)
            labels[row, len(prompt) : end] = torch.tensor(learned)
            attention_mask[row, :end] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def describe(model, tokenizer) -> dict:
    """What the base model does on the task: its greedy accuracy, the share of problems
    where it follows ``(a+b) mod 10`` greedily, and how often sampling (temperature 1)
    writes the true sum of a carry problem (mean, lowest and highest over the 45)."""
    eos = tokenizer.eos_token_id
    greedy = follows_rule = 0
    carry_rates = []
    generator = torch.Generator().manual_seed(RECIPE["seed"])
    with torch.no_grad():
        for a in range(10):
            for b in range(10):
                prompt = torch.tensor([tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]])
                out_ids = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=eos, pad_token_id=0)
                text = tokenizer.decode(out_ids[0, prompt.shape[1] :], skip_special_tokens=True).strip()
                greedy += text == f"Answer: {a + b}"
                follows_rule += text == f"Answer: {(a + b) % 10}"
                if a + b >= 10:
                    carry_rates.append(_sampled_accuracy(model, tokenizer, prompt, a + b, generator))
    return {
        "greedy_accuracy": greedy / 100,
        "follows_rule": follows_rule / 100,
        "carry_sampled_accuracy": sum(carry_rates) / len(carry_rates),
        "carry_sampled_min": min(carry_rates),
        "carry_sampled_max": max(carry_rates),
    }


def _sampled_accuracy(model, tokenizer, prompt, total: int, generator) -> float:
    """The share of :data:`CARRY_SAMPLES` temperature-1 samples that answer ``total``."""
    rows = prompt.repeat(CARRY_SAMPLES, 1)
    for _ in range(4):  # "Answer: ", two digits, EOS
        logits = model(input_ids=rows).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        rows = torch.cat([rows, token], dim=1)
    texts = tokenizer.batch_decode(rows[:, prompt.shape[1] :])
    return sum(text.split("<eos>")[0] == f"Answer: {total}" and "<eos>" in text for text in texts) / CARRY_SAMPLES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="demo folder (base model in OUT/base, data in OUT/data)")
    parser.add_argument(
        "--model-config",
        type=Path,
        default=MODEL_CONFIG,
        help="the base model's config.json (default: the Qwen2 one; model_config_moe.json: Qwen3-MoE)",
    )
    args = parser.parse_args(argv)
    if not args.model_config.is_file():
        parser.error(f"--model-config {args.model_config}: no such file")
    recipe = {**RECIPE, "model": json.loads(args.model_config.read_text())}
    base, data = args.out / "base", args.out / "data"
    stamp = base / "demo_recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe and (data / "val.jsonl").exists():
        print(f"demo: base model and data already in {args.out}")
        return 0
    start = time.perf_counter()
    base.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(base)
    write_task(data)
    report = describe(warm_up(base, tokenizer, args.model_config), tokenizer)
    stamp.write_text(json.dumps(recipe))
    (base / "demo_base_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"demo: base model written to {base} after {RECIPE['sft_steps']} supervised steps "
        f"({time.perf_counter() - start:.0f} s): greedy, it follows (a+b) mod 10 on {report['follows_rule']:.0%} "
        f"of the problems and answers {report['greedy_accuracy']:.0%} right; sampled, it writes the carried sum "
        f"{report['carry_sampled_accuracy']:.0%} of the time (per carry problem: "
        f"{report['carry_sampled_min']:.0%}-{report['carry_sampled_max']:.0%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
