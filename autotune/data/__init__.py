"""The user's data, from what they type to what a run (or a probe's shape) is made of.

    text       a local file or hub data set read and checked: its text, its splits; packing into blocks
    task_data  each task's columns, labels, examples and collator, as the HF example scripts make them
    tokenizer  the tokenizer that encodes the data, checked against the model
    options    what the user typed: --dataset and its column and tokenizer flags
    shape      the data's longest example: the longest batch a search or a plan probes (`--dataset`)

Only `datasets` and `transformers` (tokenizers) when the functions run: no torch at import.
"""

from autotune.data.text import (
    DEFAULT_TEXT_COLUMN,
    Blocks,
    DatasetSource,
    TextData,
    load_text,
    pack_blocks,
    parse_source,
    text_column,
)

__all__ = [
    "DEFAULT_TEXT_COLUMN",
    "Blocks",
    "DatasetSource",
    "TextData",
    "load_text",
    "pack_blocks",
    "parse_source",
    "text_column",
]
