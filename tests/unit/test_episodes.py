"""Multi-turn episodes, token in and token out: the engine's ids and log-probs kept as
sampled, observations' ids between them out of the loss, bounds, seeds; the calculator
environment; ``rollout.env``'s names; the loss mask in the actor's batch."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.config import AlgorithmConfig
from dapo_megatron.data import Prompt
from dapo_megatron.rollout.engine import Generation, SamplingParams
from dapo_megatron.rollout.seeds import continuation_seed
from dapo_megatron.sampling.environments import Environment, Episode, Observation, resolve_environment
from dapo_megatron.sampling.environments.calculator import CalculatorEnvironment, CalculatorError, evaluate
from dapo_megatron.sampling.episodes import run_episodes
from dapo_megatron.sampling.samples import Sample, build_policy_batch, load_samples, save_samples
from tests.unit.test_hf_engine import real_qwen_tokenizer

EOS = 1


class CharTokenizer:
    """One token per character (id = code point + 10), EOS 1 (written as NUL): a tokenizer
    whose decoding and encoding always agree, so a test sees exactly which ids went where."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [EOS if c == "\0" else ord(c) + 10 for c in text]

    def __len__(self) -> int:
        return 0x110000 + 10

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(("" if skip_special_tokens else "\0") if i == EOS else chr(i - 10) for i in ids)


TOKENIZER = CharTokenizer()


class _Bracket(Environment):
    """A tool call is ``[...]`` (the turn stops at ``]``); it is answered ``={length}.``;
    a turn without one ends the episode with reward 1. Counts its episodes' closes."""

    stop_strings = ("]",)
    closed = 0

    def start(self, prompt: Prompt) -> Episode:
        environment = self

        class _Episode(Episode):
            def step(self, turn_ids, turn_text):
                if turn_text.endswith("]"):
                    return Observation(text=f"={len(turn_text)}.", tool_calls=1)
                return Observation(done=True, reward=1.0)

            def close(self):
                environment.closed += 1

        return _Episode()


def _prompt(index: int, text: str = "go:") -> Prompt:
    return Prompt(index, tuple(TOKENIZER.encode(text)), "x", "test", text)


class _Scripted:
    """An engine that answers each row with its next scripted turn (text, finish reason):
    log-prob of the k-th token of a turn -0.01 * (k + 1); it records every request."""

    def __init__(self, turns: dict[int, list[tuple[str, str]]]) -> None:
        self.turns = {row: list(script) for row, script in turns.items()}
        self.requests: list[tuple[list[list[int]], SamplingParams]] = []

    def __call__(self, contexts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.requests.append(([list(c) for c in contexts], params))
        out = []
        for index, context in enumerate(contexts):
            row = self.row_of[tuple(context[:3])]
            text, reason = self.turns[row].pop(0)
            ids = TOKENIZER.encode(text) + ([EOS] if reason == "eos" else [])
            out.append(
                Generation(
                    index, ids, [-0.01 * (k + 1) for k in range(len(ids))], "stop" if reason == "eos" else reason
                )
            )
        return out


def test_a_multi_turn_episode_is_the_engines_tokens_and_the_observations_ids():
    prompts = [_prompt(0, "ab:"), _prompt(1, "cd:")]
    engine = _Scripted({0: [("[xy]", "stop"), ("ok", "eos")], 1: [("done", "eos")]})
    engine.row_of = {tuple(TOKENIZER.encode("ab:")): 0, tuple(TOKENIZER.encode("cd:")): 1}
    environment = _Bracket()
    params = SamplingParams(temperature=1.0, max_new_tokens=16, row_seeds=(11, 22))
    first, second = run_episodes(engine, prompts, 1, params, environment, TOKENIZER, max_turns=4, max_tokens=40)

    turn1, observation, turn2 = TOKENIZER.encode("[xy]"), TOKENIZER.encode("=4."), TOKENIZER.encode("ok") + [EOS]
    assert first.token_ids == turn1 + observation + turn2
    assert first.log_probs == [-0.01, -0.02, -0.03, -0.04] + [0.0] * 3 + [-0.01, -0.02, -0.03]
    assert first.model_mask == [1] * 4 + [0] * 3 + [1] * 3 and first.observation_tokens == 3
    assert (first.turns, first.tool_calls, first.finish_reason, first.reward) == (2, 1, "stop", 1.0)
    assert second.token_ids == TOKENIZER.encode("done") + [EOS] and second.model_mask == [1] * 5
    assert (second.turns, second.tool_calls, second.finish_reason) == (1, 0, "stop")
    # The second turn continues from the exact ids so far, with a seed of its own; the
    # turn may not run past what is left of the episode's token budget.
    (contexts1, params1), (contexts2, params2) = engine.requests
    assert params1.row_seeds == (11, 22) and params1.stop_strings == ("]",) and params1.max_new_tokens == 16
    assert contexts2 == [TOKENIZER.encode("ab:") + turn1 + observation]
    assert params2.row_seeds == (continuation_seed(11, 7),) and params2.max_new_tokens == 16
    assert environment.closed == 2 and first.retokenized_differs == second.retokenized_differs == 0


def test_bounds_end_episodes_and_every_episode_is_closed():
    prompts = [_prompt(0, "p0:"), _prompt(1, "p1:"), _prompt(2, "p2:")]
    script = {
        0: [("[a]", "stop")] * 3,  # calls the tool every turn: max_turns
        1: [("[abcdefghijklmnop]", "stop")],  # its observation does not fit the budget: length
        2: [("ab", "abort")],  # the engine gave up
    }
    engine = _Scripted(script)
    engine.row_of = {tuple(TOKENIZER.encode(f"p{i}:")): i for i in range(3)}
    environment = _Bracket()
    params = SamplingParams(max_new_tokens=20, row_seeds=(1, 2, 3))
    turns, length, aborted = run_episodes(
        engine, prompts, 1, params, environment, TOKENIZER, max_turns=3, max_tokens=20
    )
    assert (turns.finish_reason, turns.turns, turns.tool_calls) == ("max_turns", 3, 3)
    assert len(turns.token_ids) == 3 * 3 + 2 * 3  # three calls, two observations: the last turn is not answered
    called = TOKENIZER.encode("[abcdefghijklmnop]")
    assert (length.finish_reason, length.token_ids) == ("length", called + TOKENIZER.encode("=1"))  # of "=18."
    assert length.model_mask == [1] * 18 + [0] * 2
    assert (aborted.finish_reason, aborted.turns) == ("abort", 1)
    assert environment.closed == 3
    # A turn asks for no more tokens than the episode has left (row 0 holds 6, then 12).
    assert [params.max_new_tokens for _, params in engine.requests] == [20, 14, 8]


def test_each_row_is_cut_at_its_own_budget_not_at_the_smallest():
    """Row 0 has 2 tokens left, row 1 ten: the request asks for ten; row 0's turn is cut at
    its two (length), row 1's is whole."""
    prompts = [_prompt(0, "p0:"), _prompt(1, "p1:")]
    engine = _Scripted({0: [("[abcdefgh]", "stop"), ("xyz", "eos")], 1: [("[a]", "stop"), ("abcdefg", "eos")]})
    engine.row_of = {tuple(TOKENIZER.encode(f"p{i}:")): i for i in range(2)}
    params = SamplingParams(max_new_tokens=30, row_seeds=(1, 2))
    cut, whole = run_episodes(engine, prompts, 1, params, _Bracket(), TOKENIZER, max_turns=3, max_tokens=16)
    # Row 0: 10 + "=10." (4) = 14, 2 left; row 1: 3 + "=3." (3) = 6, 10 left.
    assert engine.requests[1][1].max_new_tokens == 10
    assert (cut.finish_reason, cut.token_ids[14:], cut.log_probs[14:]) == (
        "length",
        TOKENIZER.encode("xy"),
        [-0.01, -0.02],
    )
    assert (whole.finish_reason, whole.token_ids[6:]) == ("stop", TOKENIZER.encode("abcdefg") + [EOS])


def test_an_episode_whose_environment_raises_is_closed_and_the_error_named():
    class _Raising(_Bracket):
        def start(self, prompt):
            episode = super().start(prompt)
            episode.step = lambda ids, text: (_ for _ in ()).throw(RuntimeError("the tool broke"))
            return episode

    engine = _Scripted({0: [("[a]", "stop")]})
    engine.row_of = {tuple(TOKENIZER.encode("p0:")): 0}
    environment = _Raising()
    with pytest.raises(RuntimeError, match="the tool broke"):
        run_episodes(
            engine, [_prompt(0, "p0:")], 1, SamplingParams(), environment, TOKENIZER, max_turns=2, max_tokens=9
        )
    assert environment.closed == 1


def test_the_model_mask_keeps_observations_out_of_the_loss():
    prompt = _prompt(0, "ab:")
    samples = [
        Sample((0, 0), prompt, [5, 6, 7, 8, 9], [0.0] * 5, "stop", "", score=1.0, model_mask=[1, 0, 0, 1, 1]),
        Sample((0, 0), prompt, [5, 6], [0.0] * 2, "length", "", score=0.0),
    ]
    batch = build_policy_batch(samples, AlgorithmConfig(overlong_filter=False))
    assert batch.response_mask()[0].tolist() == [0, 0, 0, 1, 0, 0, 1, 1]
    assert batch.response_mask()[1].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    filtered = build_policy_batch(samples, AlgorithmConfig(overlong_filter=True))
    assert filtered.response_mask()[0].tolist() == [0, 0, 0, 1, 0, 0, 1, 1]
    assert filtered.response_mask()[1].sum() == 0  # truncated: out of the loss, as without episodes


def test_a_saved_batch_keeps_its_episodes_masks(tmp_path):
    """A checkpoint's batch generated ahead (``save_samples``) trains as it would have."""
    prompt = _prompt(0, "ab:")
    samples = [
        Sample((0, 0), prompt, [5, 6, 7, 8, 9], [-0.5] * 5, "stop", "", score=1.0, model_mask=[1, 0, 0, 1, 1]),
        Sample((0, 0), prompt, [5, 6], [-0.25] * 2, "stop", "", score=-1.0, model_mask=[1, 1]),
    ]
    save_samples(tmp_path / "ahead.pt", samples, {})
    loaded, _ = load_samples(tmp_path / "ahead.pt")
    assert [s.model_mask for s in loaded] == [[1, 0, 0, 1, 1], [1, 1]]
    config = AlgorithmConfig()
    assert torch.equal(
        build_policy_batch(loaded, config).response_mask(), build_policy_batch(samples, config).response_mask()
    )


def test_decode_then_encode_changes_a_real_tokenizers_turn_and_is_counted():
    """Qwen's tokenizer: a turn the engine sampled as ``hel`` + ``lo`` decodes to "hello",
    which encodes as one token; the trajectory counts the turn, and keeps the sampled ids."""
    qwen = real_qwen_tokenizer()
    sampled = qwen.encode("hel", add_special_tokens=False) + qwen.encode("lo", add_special_tokens=False)
    assert qwen.encode(qwen.decode(sampled), add_special_tokens=False) != sampled

    class _Once(Environment):
        def start(self, prompt):
            class _Done(Episode):
                def step(self, ids, text):
                    return Observation(done=True)

            return _Done()

    def generate(contexts, params):
        return [Generation(0, list(sampled), [-0.5] * len(sampled), "stop")]

    prompt = Prompt(0, tuple(qwen.encode("say hi:")), "x", "test", "say hi:")
    (trajectory,) = run_episodes(generate, [prompt], 1, SamplingParams(), _Once(), qwen, max_turns=2, max_tokens=20)
    assert trajectory.token_ids == sampled and trajectory.retokenized_differs == 1


def test_in_the_chat_format_an_observation_is_a_tool_message_of_the_chat_template():
    """``rollout.observation_format=chat`` on Qwen's template: the model's turn is closed
    as an assistant message, the observation is a tool message, and the next assistant
    message is opened, all tokenised once (the template's special tokens as such) and out
    of the loss; the model's tokens are as sampled."""
    from dapo_megatron.config import RolloutConfig
    from dapo_megatron.sampling.episodes import chat_framing, episode_rules

    qwen = real_qwen_tokenizer()
    before, after = chat_framing(qwen)
    assert (before, after) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    turns = [qwen.encode("<calc>6*7</calc>", add_special_tokens=False), qwen.encode("42", add_special_tokens=False)]
    turns[1].append(qwen.convert_tokens_to_ids("<|im_end|>"))
    answer = list(turns[1])

    def generate(contexts, params):
        return [Generation(0, turns.pop(0), [-0.25] * 9, "stop")]

    prompt = Prompt(0, tuple(qwen.encode("6*7=")), "42", "test", "6*7=")
    rules = episode_rules(RolloutConfig(env="calculator", observation_format="chat"), qwen)
    (trajectory,) = run_episodes(
        generate,
        [prompt],
        1,
        SamplingParams(),
        rules.environment,
        qwen,
        max_turns=3,
        max_tokens=80,
        framing=rules.framing,
    )
    observed = qwen.encode(before + "<result>42</result>" + after, add_special_tokens=False)
    assert (
        qwen.convert_tokens_to_ids("<|im_end|>") in observed and qwen.convert_tokens_to_ids("<|im_start|>") in observed
    )
    first = qwen.encode("<calc>6*7</calc>", add_special_tokens=False)
    assert trajectory.token_ids[: len(first) + len(observed)] == first + observed
    assert trajectory.token_ids[len(first) + len(observed) :] == answer
    assert trajectory.model_mask == [1] * len(first) + [0] * len(observed) + [1] * len(answer)
    assert qwen.decode(trajectory.token_ids).endswith("<|im_start|>assistant\n42<|im_end|>")
    # A tokenizer without a chat template cannot frame observations as chat messages.
    with pytest.raises(ValueError, match="observation_format=chat: the run's tokenizer has no chat template"):
        episode_rules(RolloutConfig(env="calculator", observation_format="chat"), TOKENIZER)
    assert episode_rules(RolloutConfig(env="calculator"), TOKENIZER).framing == ("", "")


def test_the_calculator_evaluates_integer_arithmetic_only():
    assert evaluate("123 * 456") == 56088 and evaluate("-(7 - 10) // 2 + 9 % 4") == 2
    for expression, why in (
        ("2 ** 10", "Pow is not integer arithmetic"),
        ("__import__('os')", "Call is not integer arithmetic"),
        ("1.5 * 2", "Constant is not integer arithmetic"),
        ("7 // 0", "division by zero"),
        ("1" + "0" * 29 + " * 10", "more than 30 digits"),
        ("9" * 31, "more than 30 digits"),
        ("1 +", "not an expression"),
        ("1+" * 101 + "1", "longer than 200 characters"),
    ):
        with pytest.raises(CalculatorError, match=why.replace("*", r"\*")):
            evaluate(expression)
    episode = CalculatorEnvironment().start(_prompt(0))
    assert episode.step([], "so <calc>12*3</calc>") == Observation(text="<result>36</result>", tool_calls=1)
    assert episode.step([], "<calc>1//0</calc>") == Observation(
        text="<result>error: division by zero</result>", tool_calls=1, tool_errors=1
    )
    assert episode.step([], "Answer: 36").done
    # The token that completes the tag may carry more; the call follows the last opening tag.
    assert episode.step([], "<calc>2*21</calc>.").text == "<result>42</result>"
    assert episode.step([], "use <calc> then <calc>2*3</calc>").text == "<result>6</result>"


def test_environments_are_named_or_given_as_module_and_class():
    assert resolve_environment("calculator") is CalculatorEnvironment
    assert resolve_environment("tests.unit.test_episodes:_Bracket") is _Bracket
    with pytest.raises(
        ValueError, match="unknown environment .abacus.; registered: calculator, python, or name your own"
    ):
        resolve_environment("abacus")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        resolve_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="test_episodes.CharTokenizer is type, not a subclass of"):
        resolve_environment("tests.unit.test_episodes:CharTokenizer")


class _EmptyStop(_Bracket):
    stop_strings = ("",)


class _BadIds(_Bracket):
    def start(self, prompt):
        class _Episode(Episode):
            def step(self, turn_ids, turn_text):
                return Observation(token_ids=(5, -1))

        return _Episode()


def test_an_empty_stop_string_and_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="stop_strings must be a tuple of non-empty strings"):
        resolve_environment("tests.unit.test_episodes:_EmptyStop")
    engine = _Scripted({0: [("[a]", "stop")]})
    engine.row_of = {tuple(TOKENIZER.encode("p0:")): 0}
    with pytest.raises(ValueError, match=r"observation holds token ids \[-1\] outside the tokenizer's"):
        run_episodes(engine, [_prompt(0, "p0:")], 1, SamplingParams(), _BadIds(), TOKENIZER, max_turns=2, max_tokens=9)


def test_observations_must_say_something_unless_the_episode_ends():
    with pytest.raises(ValueError, match="needs text or token_ids"):
        Observation()
    with pytest.raises(ValueError, match="tool_calls=1 >= tool_errors=2"):
        Observation(done=True, tool_calls=1, tool_errors=2)
    assert torch.tensor(Observation(token_ids=(3, 4)).token_ids).tolist() == [3, 4]
