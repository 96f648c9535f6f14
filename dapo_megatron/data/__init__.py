"""Training and validation prompts in the DAPO-Math schema (parquet or JSONL)."""

from dapo_megatron.data.prompts import (
    DataError,
    Prompt,
    PromptDataset,
    PromptLoader,
    decoded_prompt,
    describe_prompt,
    load_tokenizer,
    validation_dataset,
    warn_if_prompts_lose_text,
)

__all__ = [
    "DataError",
    "Prompt",
    "PromptDataset",
    "PromptLoader",
    "decoded_prompt",
    "describe_prompt",
    "load_tokenizer",
    "validation_dataset",
    "warn_if_prompts_lose_text",
]
