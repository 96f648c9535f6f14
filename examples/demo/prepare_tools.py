"""Prepare the tool demo: three-digit multiplication, which a tiny model cannot do in its
head but can with a calculator.

- **Task**: ``a*b=`` for a, b in 100..999 (1,000 training problems, 100 validation
  problems, drawn apart), written as DAPO-Math rows and graded by the real ``dapo_math``
  reward on the whole episode's text.
- **Tool**: the ``calculator`` environment. The model writes ``<calc>a*b</calc>`` (the turn
  ends there), reads ``<result>N</result>``, and answers ``Answer: N``.
- **Tokenizer**: 20 tokens (digits, ``*``, ``=``, ``Answer: ``, the four tags, newline, EOS,
  PAD), saved with ``transformers`` in ``OUT_DIR/tokenizer``, a folder of its own:
  ``AutoTokenizer`` reads a folder that also holds a Qwen2 ``config.json`` as a Qwen2
  tokenizer, whose own pre-tokenizer would split the tags apart (the config names the
  folder as ``data.tokenizer``).
- **Base model**: the demo's tiny Qwen2 (``model_config_tools.json``: 3 layers, hidden 128),
  supervised the way a pretrained model comes to RL: in ``tool_share`` of its examples it
  calls the calculator and copies the result into its answer (the result's tokens are in
  the context, out of the loss, as in training), in the others it answers at once with a
  number of the right length that is almost never the product (a guess). Greedy, it
  guesses; sampled, it calls the tool about a third of the time, and then it is mostly
  right. DAPO has to find from the reward alone that calling the tool pays.

Everything is seeded; running it twice gives the same files. Usage:
``python examples/demo/prepare_tools.py OUT_DIR`` (``make demo-tools`` uses
``runs/demo_tools``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prepare import build_tokenizer, new_model, supervise  # noqa: E402 - the demo's own helpers

VOCAB = [
    "<pad>",
    "<eos>",
    *[str(d) for d in range(10)],
    "*",
    "=",
    "Answer: ",
    "<calc>",
    "</calc>",
    "<result>",
    "</result>",
    "\n",
]
PATTERN = r"Answer: |</?calc>|</?result>|\d|\*|=|\n"
MODEL_CONFIG = Path(__file__).with_name("model_config_tools.json")
RECIPE = {
    "model": json.loads(MODEL_CONFIG.read_text()),
    "sft_steps": 800,
    "sft_batch": 64,
    "sft_lr": 2e-3,
    "sft_warmup_steps": 50,
    "tool_share": 0.3,
    "train_problems": 1000,
    "val_problems": 100,
    "seed": 0,
}
"""The supervised warm-up (see ``prepare.supervise``); an example calls the calculator with
probability ``tool_share``."""
SAMPLES = 4
"""Samples per validation problem (temperature 1) for the base model's report."""


def problems(count: int, seed: int, exclude: frozenset = frozenset()) -> list[tuple[int, int]]:
    """``count`` distinct problems ``(a, b)`` drawn with ``seed``, none in ``exclude``."""
    rng = random.Random(seed)
    drawn: dict[tuple[int, int], None] = {}
    while len(drawn) < count:
        pair = (rng.randrange(100, 1000), rng.randrange(100, 1000))
        if pair not in exclude:
            drawn[pair] = None
    return list(drawn)


def write_task(data_dir: Path) -> None:
    """The training and validation problems as DAPO-Math rows."""
    data_dir.mkdir(parents=True, exist_ok=True)
    validation = problems(RECIPE["val_problems"], RECIPE["seed"] + 1)
    training = problems(RECIPE["train_problems"], RECIPE["seed"] + 2, frozenset(validation))
    for name, pairs in (("train.jsonl", training), ("val.jsonl", validation)):
        rows = [
            {
                "data_source": "demo_multiplication",
                "prompt": [{"role": "user", "content": f"{a}*{b}="}],
                "reward_model": {"ground_truth": str(a * b), "style": "rule"},
            }
            for a, b in pairs
        ]
        (data_dir / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def warm_up(out: Path, tokenizer):
    """The supervised warm-up; saves the model to ``out`` and returns it."""
    torch.manual_seed(RECIPE["seed"])
    rng = random.Random(RECIPE["seed"])
    model = new_model(MODEL_CONFIG, tokenizer, len(VOCAB))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def example() -> tuple[list[int], list[int], list[int]]:
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        product = a * b
        if rng.random() < RECIPE["tool_share"]:
            call, result = encode(f"<calc>{a}*{b}</calc>"), encode(f"<result>{product}</result>")
            answer = encode(f"Answer: {product}") + [tokenizer.eos_token_id]
            return encode(f"{a}*{b}="), call + result + answer, call + [-100] * len(result) + answer
        digits = len(str(product))
        guess = encode(f"Answer: {rng.randrange(10 ** (digits - 1), 10**digits)}") + [tokenizer.eos_token_id]
        return encode(f"{a}*{b}="), guess, guess

    supervise(model, example, RECIPE, tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return model


def episode(model, tokenizer, a: int, b: int, *, greedy: bool, generator=None, tool: bool = True) -> str:
    """One episode's text after the prompt: the model's turns and, with ``tool``, the
    calculator's results (without, a turn runs on past ``</calc>``)."""
    from dapo_megatron.sampling.environments.calculator import CalculatorEnvironment

    ids = tokenizer(f"{a}*{b}=", add_special_tokens=False)["input_ids"]
    start, stop = len(ids), VOCAB.index("</calc>")
    calculator = CalculatorEnvironment().start(None)
    for _ in range(3):
        turn: list[int] = []
        for _ in range(16):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + turn])).logits[0, -1].float()
            if greedy:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            turn.append(token)
            if token == tokenizer.eos_token_id or (tool and token == stop):
                break
        ids += turn
        if not (tool and turn[-1] == stop):
            break
        observation = calculator.step(turn, tokenizer.decode(turn))
        ids += tokenizer(observation.text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[start:], skip_special_tokens=True)


def describe(model, tokenizer, val_file: Path) -> dict:
    """What the base model does on the validation problems: greedy accuracy with and
    without the tool; sampled (temperature 1), how often it calls the tool and how often
    it is right when it does."""
    from dapo_megatron.algo.rewards.dapo_math import dapo_math_reward

    rows = [json.loads(line) for line in val_file.read_text().splitlines()]
    pairs = [tuple(map(int, row["prompt"][0]["content"].rstrip("=").split("*"))) for row in rows]

    def right(text: str, a: int, b: int) -> bool:
        return dapo_math_reward(text, str(a * b)).correct

    generator = torch.Generator().manual_seed(RECIPE["seed"])
    sampled: list[tuple[int, int, str]] = []
    for _ in range(SAMPLES):
        sampled += [(a, b, episode(model, tokenizer, a, b, greedy=False, generator=generator)) for a, b in pairs]
    calls = [(a, b, text) for a, b, text in sampled if "<calc>" in text]
    return {
        "greedy_accuracy": sum(right(episode(model, tokenizer, a, b, greedy=True), a, b) for a, b in pairs)
        / len(pairs),
        "greedy_accuracy_without_tool": sum(
            right(episode(model, tokenizer, a, b, greedy=True, tool=False), a, b) for a, b in pairs
        )
        / len(pairs),
        "sampled_accuracy": sum(right(text, a, b) for a, b, text in sampled) / len(sampled),
        "sampled_tool_share": len(calls) / len(sampled),
        "sampled_accuracy_with_tool": sum(right(text, a, b) for a, b, text in calls) / max(len(calls), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="demo folder (base model in OUT/base, data in OUT/data)")
    args = parser.parse_args(argv)
    base, data, tokenizer_dir = args.out / "base", args.out / "data", args.out / "tokenizer"
    stamp = base / "demo_recipe.json"
    prepared = (data / "val.jsonl").exists() and (tokenizer_dir / "tokenizer.json").exists()
    if stamp.exists() and json.loads(stamp.read_text()) == RECIPE and prepared:
        print(f"demo-tools: base model and data already in {args.out}")
        return 0
    start = time.perf_counter()
    base.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tokenizer_dir, VOCAB, PATTERN)
    write_task(data)
    report = describe(warm_up(base, tokenizer), tokenizer, data / "val.jsonl")
    stamp.write_text(json.dumps(RECIPE))
    (base / "demo_base_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"demo-tools: base model written to {base} after {RECIPE['sft_steps']} supervised steps "
        f"({time.perf_counter() - start:.0f} s): greedy, it answers {report['greedy_accuracy']:.0%} right "
        f"({report['greedy_accuracy_without_tool']:.0%} without the tool); sampled, it calls the calculator "
        f"{report['sampled_tool_share']:.0%} of the time and is then right {report['sampled_accuracy_with_tool']:.0%} "
        f"of the time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
