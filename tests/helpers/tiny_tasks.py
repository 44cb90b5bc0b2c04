"""Tiny configs of the model families each task is trained with (config.json contents, as a local
model directory holds them): a few hundred thousand parameters each, so that a probe, a trace or
two training steps take seconds on CPU. Shared by the task tests of probe, estimate, search and
train."""

from __future__ import annotations

import json
from pathlib import Path

_SMALL = {"vocab_size": 1024, "max_position_embeddings": 256}
_BART_LIKE = {
    **_SMALL,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "is_encoder_decoder": True,
}
_BERT_LIKE = {**_SMALL, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}

TINY = {
    "pegasus": {
        "model_type": "pegasus",
        "architectures": ["PegasusForConditionalGeneration"],
        **_BART_LIKE,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    },
    "bart": {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        **_BART_LIKE,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
    },
    "t5": {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": 1024,
        "d_model": 64,
        "d_kv": 32,
        "d_ff": 128,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 2,
        "n_positions": 256,
        "is_encoder_decoder": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    },
    "bert-classification": {
        "model_type": "bert",
        "architectures": ["BertForSequenceClassification"],
        **_BERT_LIKE,
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
        "label2id": {"negative": 0, "neutral": 1, "positive": 2},
    },
    "bert-mlm": {"model_type": "bert", "architectures": ["BertForMaskedLM"], **_BERT_LIKE},
    "distilbert": {
        "model_type": "distilbert",
        "architectures": ["DistilBertForMaskedLM"],
        **_SMALL,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 2,
        "hidden_dim": 128,
    },
    # RoBERTa counts positions from pad_token_id + 1: 258 positions hold 256 tokens.
    "roberta": {
        "model_type": "roberta",
        "architectures": ["RobertaForMaskedLM"],
        **_BERT_LIKE,
        "max_position_embeddings": 258,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
}
# The task each family's architectures name.
TASK_OF = {
    "pegasus": "seq2seq",
    "bart": "seq2seq",
    "t5": "seq2seq",
    "bert-classification": "classification",
    "bert-mlm": "masked-lm",
    "distilbert": "masked-lm",
    "roberta": "masked-lm",
}


def write_tiny(root: Path, family: str, **overrides) -> Path:
    """A model directory holding only `family`'s tiny config.json."""
    path = root / family
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY[family], **overrides}))
    return path
