"""Text and tokenizers made here (no download): a real English corpus from the standard library
(`pydoc_data.topics`), tokenizers trained on it in about a second, and a tiny GPT-2 with real
(random) weights as a user's directory holds one."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.models import TINY_GPT2

SPECIAL = "<|endoftext|>"


def corpus_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def write_tokenizer(text: str, directory: Path, vocab_size: int = 500) -> None:
    """A byte-level BPE tokenizer trained on `text` in about a second, saved as transformers loads it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [text], vocab_size=vocab_size, min_frequency=2, special_tokens=[SPECIAL], show_progress=False
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=SPECIAL, eos_token=SPECIAL, unk_token=SPECIAL
    )
    fast.save_pretrained(directory)


# The special tokens of the task tests' tokenizer, ids 0-5: T5's pad 0 and end 1, BERT's pad 0.
TASK_SPECIALS = {
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}


def write_task_tokenizer(text: str, directory: Path, vocab_size: int = 500, *, mask: bool = True) -> None:
    """A word-level tokenizer trained on `text` in a fraction of a second, with the special tokens
    of seq2seq, classification and (with `mask`) masked-LM models, saved as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = {name: token for name, token in TASK_SPECIALS.items() if mask or name != "mask_token"}
    words = Tokenizer(models.WordLevel(unk_token=TASK_SPECIALS["unk_token"]))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(
        [text],
        trainers.WordLevelTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=list(specials.values())),
    )
    PreTrainedTokenizerFast(tokenizer_object=words, **specials).save_pretrained(directory)


def write_weights(directory: Path, config: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(directory)


def write_pretrained_gpt2(text: str, directory: Path) -> Path:
    """A tiny GPT-2 as a user's directory holds one: config.json, a tokenizer trained on `text`, weights."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_GPT2))
    write_tokenizer(text, directory)
    write_weights(directory, TINY_GPT2)
    return directory
