"""What a tool call adds to a step, measured side by side in one run.

Run: ``.venv/bin/python benchmarks/bench_tool_call.py [--repeats 5] [--json FILE]``
(after ``make demo-tools``, whose base model and tokenizer it loads from
``runs/demo_tools``).

A tool call costs two things:

- **The turn boundary, on the engine**: the turn stops at the tool's stop string, the
  observation is appended, and the next turn is a new generation whose input (prompt,
  turn, observation) is prefilled again. Measured on the transformers engine with the
  demo's tiny model, one round of the demo's 32 prompts x 8 episodes: the same number of
  new tokens generated in one turn, and in two turns with a 8-token observation between
  them (the calculator's ``<result>NNNNNN</result>``), greedy so that every row runs to
  its budget. The difference is what the boundary adds to a round.
- **The tool itself**: the calculator (an ``ast`` evaluation) and the ``python``
  environment's sandbox (a fresh interpreter per block), one block at a time and
  ``workers`` at a time.

Each figure is the median of ``--repeats`` runs; the machine's and the date's figures
belong with the result (docs/environments.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO = REPO / "runs" / "demo_tools"
ROWS = 32 * 8
FIRST, OBSERVATION, SECOND = 9, 8, 8
"""The demo's episode: a 9-token call, an 8-token result, an 8-token answer."""


def _median_seconds(run, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def turn_boundary(repeats: int) -> dict[str, float]:
    """One round of the demo's episodes generated as one turn and as two."""
    import torch
    from transformers import AutoTokenizer

    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.rollout.hf_engine import HFRolloutEngine

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    engine = HFRolloutEngine.from_pretrained(DEMO / "base", tokenizer=tokenizer)
    prompts = [tokenizer.encode(f"{100 + i}*{200 + i}=", add_special_tokens=False) for i in range(ROWS)]
    observation = tokenizer.encode("<result>123456</result>", add_special_tokens=False)
    assert len(observation) == OBSERVATION
    never = (tokenizer.convert_tokens_to_ids("<pad>"),)  # greedy rows run to their budget

    def one_turn() -> None:
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=FIRST + SECOND, stop_token_ids=never))

    def two_turns() -> None:
        first = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=FIRST, stop_token_ids=never))
        contexts = [p + g.token_ids + observation for p, g in zip(prompts, first)]
        engine.generate(contexts, SamplingParams(temperature=0, max_new_tokens=SECOND, stop_token_ids=never))

    one_turn(), two_turns()  # warm up
    one, two = _median_seconds(one_turn, repeats), _median_seconds(two_turns, repeats)
    return {"one_turn_s": one, "two_turns_s": two, "added_per_round_s": two - one, "rows": ROWS}


def tools(repeats: int) -> dict[str, float]:
    """Seconds per call of the calculator and of the sandboxed interpreter."""
    from dapo_megatron.sampling.environments import make_environment
    from dapo_megatron.sampling.episodes import environment_answers

    calculator = make_environment("calculator", {}).start(None)
    calls = 1000
    calculator_s = _median_seconds(lambda: [calculator.step([], "<calc>983*969</calc>") for _ in range(calls)], repeats)
    out = {"calculator_call_s": calculator_s / calls}
    block = "<code>print(983*969)</code>"
    for workers in (1, 4):
        python = make_environment("python", {"workers": workers})
        episodes = [python.start(None) for _ in range(16)]
        asked = [(episode, [], block) for episode in episodes]
        wall = _median_seconds(lambda env=python, asked=asked: environment_answers(env, asked), repeats)
        out[f"python_{workers}_workers_call_s"] = wall / len(episodes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not (DEMO / "base" / "model.safetensors").is_file():
        parser.error(f"no demo-tools base model in {DEMO}: run `make demo-tools` (or examples/demo/prepare_tools.py)")
    result = {**turn_boundary(args.repeats), **tools(args.repeats)}
    print(
        f"turn boundary, transformers engine, {ROWS} episodes: one turn of {FIRST + SECOND} tokens "
        f"{result['one_turn_s']:.3f} s, two turns ({FIRST} + {SECOND}, a {OBSERVATION}-token observation between) "
        f"{result['two_turns_s']:.3f} s: +{result['added_per_round_s']:.3f} s per round"
    )
    print(
        f"tool: calculator {result['calculator_call_s'] * 1e6:.1f} us per call; python sandbox "
        f"{result['python_1_workers_call_s'] * 1e3:.0f} ms per block one at a time, "
        f"{result['python_4_workers_call_s'] * 1e3:.0f} ms per block with 4 workers"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
