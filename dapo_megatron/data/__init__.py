"""Training and validation prompts in the DAPO-Math schema (parquet or JSONL)."""

from dapo_megatron.data.prompts import (
    DataError,
    Prompt,
    PromptDataset,
    PromptLoader,
    load_tokenizer,
    validation_dataset,
)

__all__ = ["DataError", "Prompt", "PromptDataset", "PromptLoader", "load_tokenizer", "validation_dataset"]
