"""The prompt loader: schema checks that name file, row and column; counts; epochs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_megatron.config import DataConfig
from dapo_megatron.data import DataError, PromptDataset, PromptLoader


class CharTokenizer:
    """One token per character; no chat template (the plain template applies)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def row(content="1+1=", answer="2", source="s"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": answer},
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_parquet_and_jsonl_give_the_same_prompts(tmp_path):
    rows = [row(f"{i}+1=", str(i + 1)) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    a = PromptDataset([str(tmp_path / "p.parquet")], CharTokenizer(), DataConfig(), 100)
    b = PromptDataset([write_jsonl(tmp_path / "p.jsonl", rows)], CharTokenizer(), DataConfig(), 100)
    assert [(p.token_ids, p.ground_truth, p.data_source) for p in a.prompts] == [
        (p.token_ids, p.ground_truth, p.data_source) for p in b.prompts
    ]
    assert a.prompts[3].text == "3+1=" and a.prompts[3].ground_truth == "4" and a.prompts[3].prompt_id == 3


def test_a_system_prompt_goes_before_every_prompt_unless_the_row_has_its_own(tmp_path):
    from tests.unit.test_hf_engine import real_qwen_tokenizer

    own = {
        **row("2+2=", "4"),
        "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2="}],
    }
    path = write_jsonl(tmp_path / "p.jsonl", [row("1+1=", "2"), own])
    data = DataConfig(system_prompt="Use <code> blocks.")
    plain = PromptDataset([path], CharTokenizer(), data, 100)  # no chat template: one line per message
    assert [p.text for p in plain.prompts] == ["Use <code> blocks.\n1+1=", "Be terse.\n2+2="]
    tokenizer = real_qwen_tokenizer()
    templated = PromptDataset([path], tokenizer, data, 100)
    assert templated.prompts[0].text.startswith(
        "<|im_start|>system\nUse <code> blocks.<|im_end|>\n<|im_start|>user\n1+1="
    )
    assert "Use <code>" not in templated.prompts[1].text
    assert "Use <code>" not in PromptDataset([path], tokenizer, DataConfig(), 100).prompts[0].text


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"data_source": "s", "prompt": [{"role": "user", "content": "x"}], "reward_model": {}},
            "line 3: column 'reward_model.ground_truth' is missing",
        ),
        ({"data_source": "s", "reward_model": {"ground_truth": "1"}}, "line 3: column 'prompt' is missing"),
        (
            {**row(), "prompt": [{"role": "user"}]},
            "line 3: column 'prompt': every message needs a string 'role' and 'content'",
        ),
        ({**row(), "prompt": []}, "line 3: column 'prompt': expected a non-empty list of chat messages"),
        (
            {**row(), "reward_model": {"ground_truth": None}},
            "line 3: column 'reward_model.ground_truth' must hold an answer",
        ),
        (
            {**row(), "reward_model": {"ground_truth": "  "}},
            "line 3: column 'reward_model.ground_truth' must hold an answer, found '  ' .*can never be scored",
        ),
        ({**row(), "reward_model": {"ground_truth": ""}}, "line 3: column 'reward_model.ground_truth' must hold an"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row(), row(), bad])
    with pytest.raises(DataError, match=message) as info:
        PromptDataset([path], CharTokenizer(), DataConfig(), 100)
    # The third line of the file is line 3 (as an editor numbers it), not "row 2".
    assert str(info.value).startswith(f"{path}: line 3")


def test_invalid_utf8_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    good = (json.dumps(row()) + "\n").encode()
    path.write_bytes(good + good + b'{"data_source": "s\xff"}\n')
    with pytest.raises(DataError, match=r"line 3: not valid UTF-8 .*byte 0xff") as info:
        PromptDataset([str(path)], CharTokenizer(), DataConfig(), 100)
    assert str(info.value).startswith(f"{path}: line 3")


def test_jsonl_errors_count_lines_with_blank_ones_and_parquet_counts_rows_from_0(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(row()) + "\n\n" + "{not json\n")
    with pytest.raises(DataError, match=r"gaps.jsonl: line 3: not valid JSON"):
        PromptDataset([str(path)], CharTokenizer(), DataConfig(), 100)
    pq.write_table(pa.Table.from_pylist([row(), row(answer="")]), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet: row 1: column 'reward_model.ground_truth' must hold"):
        PromptDataset([str(tmp_path / "p.parquet")], CharTokenizer(), DataConfig(), 100)


def test_the_log_says_what_deduplication_did(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [row("1+1="), row("1+1="), row("1+1="), row("2+2=", "4")])
    with caplog.at_level("INFO", logger="dapo_megatron.data.prompts"):
        PromptDataset([path], CharTokenizer(), DataConfig(deduplicate=True), 100)
    assert "4 rows, 2 distinct prompts; data.deduplicate kept 2, dropped 2 repeated rows" in caplog.text
    assert "set data.deduplicate" not in caplog.text and "data.deduplicate=true" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="dapo_megatron.data.prompts"):
        PromptDataset([path], CharTokenizer(), DataConfig(), 100)
    assert "4 rows, 2 distinct prompts; 2 rows repeat another (data.deduplicate=true keeps one copy" in caplog.text


def test_over_long_prompts_are_dropped_and_counted_and_duplicates_reported(tmp_path):
    rows = [row("1+1="), row("1+1="), row("123456789+1=", "123456790"), row("2+2=", "4")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kept = PromptDataset([path], CharTokenizer(), DataConfig(), max_prompt_length=6)
    assert kept.stats == {"rows": 4, "distinct": 3, "duplicates_removed": 0, "dropped_too_long": 1}
    assert [p.text for p in kept.prompts] == ["1+1=", "1+1=", "2+2="]
    dedup = PromptDataset([path], CharTokenizer(), DataConfig(deduplicate=True), max_prompt_length=6)
    assert dedup.stats["duplicates_removed"] == 1 and [p.text for p in dedup.prompts] == ["1+1=", "2+2="]


def test_loader_epochs_are_seeded_shuffles_and_resume_from_state(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [row(f"{i}=", str(i)) for i in range(10)])
    data = PromptDataset([path], CharTokenizer(), DataConfig(), 100)
    loader = PromptLoader(data, seed=3, shuffle=True)
    first = [p.prompt_id for p in loader.next_batch(7)]
    state = loader.state_dict()
    rest = [p.prompt_id for p in loader.next_batch(7)]
    assert sorted(first + rest[:3]) == list(range(10))  # epoch 0 is a permutation
    assert loader.epoch == 1 and first != list(range(7))
    again = PromptLoader(data, seed=3, shuffle=True)
    again.load_state_dict(state)
    assert [p.prompt_id for p in again.next_batch(7)] == rest
    other = PromptLoader(data, seed=4, shuffle=True)
    assert [p.prompt_id for p in other.next_batch(7)] != first
