"""Prepare the embedded demo: a tokenizer, a task in the DAPO-Math schema, and a base model.

Real DAPO runs start from a pretrained model that already writes answers in the expected
form but is often wrong. The demo makes one in seconds on a CPU:

- **Task**: single-digit addition, ``a+b=`` for a, b in 0..9 (100 problems), written as
  DAPO-Math rows (``prompt`` chat messages, ``reward_model.ground_truth``, ``data_source``).
  A response is ``Answer: N`` and is graded by the real ``dapo_math`` reward.
- **Tokenizer**: a 16-token Hugging Face tokenizer (digits, ``+``, ``=``, ``Answer: ``,
  newline, EOS, PAD), saved with ``transformers`` so the trainer loads it like any other.
- **Base model**: a tiny Qwen2 (3 layers, hidden 128, 4 heads, 2 KV heads, tied
  embeddings; its architecture is ``model_config.json`` next to this file), supervised for a few hundred steps on a deliberately imperfect rule,
  ``(a+b) mod 10``: it answers in the right form and is right only when there is no
  carry. DAPO then has to discover the carry from the reward alone.

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
"""The base model's architecture, committed so that demo.yaml names it before this runs."""
RECIPE = {
    "model": json.loads(MODEL_CONFIG.read_text()),
    "sft_steps": 600,
    "sft_batch": 64,
    "sft_lr": 1e-3,
    "seed": 0,
}


def build_tokenizer(out: Path):
    """The demo's tokenizer, saved to ``out`` and returned."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"Answer: |\d|\+|=|\n"), behavior="isolated")
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


def warm_up(out: Path, tokenizer) -> float:
    """Supervised warm-up on ``(a+b) mod 10``; saves the model; returns its greedy accuracy on the real task."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(RECIPE["seed"])
    rng = random.Random(RECIPE["seed"])
    config = Qwen2Config.from_json_file(MODEL_CONFIG)
    if (config.vocab_size, config.eos_token_id, config.pad_token_id) != (
        len(VOCAB),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ):
        raise SystemExit(f"{MODEL_CONFIG} disagrees with the demo tokenizer (vocabulary, EOS or PAD id)")
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["sft_lr"])
    answer = tokenizer.convert_tokens_to_ids("Answer: ")
    eos = tokenizer.eos_token_id

    def example(a: int, b: int) -> tuple[list[int], int]:
        prompt = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
        return prompt + [answer, tokenizer.convert_tokens_to_ids(str((a + b) % 10)), eos], len(prompt)

    model.train()
    for _ in range(RECIPE["sft_steps"]):
        pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(RECIPE["sft_batch"])]
        ids, prompt_len = zip(*(example(a, b) for a, b in pairs))
        input_ids = torch.tensor(ids)  # [batch, 7]: every example has the same length
        labels = input_ids.clone()
        labels[:, : prompt_len[0]] = -100  # learn the response only
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    correct = 0
    with torch.no_grad():
        for a in range(10):
            for b in range(10):
                prompt = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
                out_ids = model.generate(
                    torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=eos, pad_token_id=0
                )[0, len(prompt) :]
                text = tokenizer.decode(out_ids, skip_special_tokens=True)
                correct += text.strip() == f"Answer: {a + b}"
    return correct / 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="demo folder (base model in OUT/base, data in OUT/data)")
    args = parser.parse_args(argv)
    base, data = args.out / "base", args.out / "data"
    stamp = base / "demo_recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == RECIPE and (data / "val.jsonl").exists():
        print(f"demo: base model and data already in {args.out}")
        return 0
    start = time.perf_counter()
    base.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(base)
    write_task(data)
    accuracy = warm_up(base, tokenizer)
    stamp.write_text(json.dumps(RECIPE))
    print(
        f"demo: base model written to {base} after {RECIPE['sft_steps']} supervised steps on (a+b) mod 10 "
        f"({time.perf_counter() - start:.0f} s); its greedy accuracy on a+b: {accuracy:.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
