"""The tokenizer that encodes the user's data: the one given, else the model's own, checked to have a
vocabulary and no ids past the model's. transformers is imported inside the functions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autotune.vocabulary.errors import BadInput, ModelNotFound

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autotune.specs.models import ModelSpec


def hub_usable() -> bool:
    """Whether the Hugging Face hub may be asked: not offline, and reachable."""
    from autotune.specs.models import _hub_reachable, _offline

    return not _offline() and _hub_reachable()


def load_tokenizer(
    spec: ModelSpec, explicit: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer of `explicit`, else of the model reference; ModelNotFound saying what to pass."""
    from transformers import AutoTokenizer

    local_only = not hub_usable()  # offline, ask only the local cache rather than wait for timeouts
    candidates = [explicit] if explicit else list(dict.fromkeys(c for c in (spec.path, spec.reference) if c))
    reasons = []
    for candidate in candidates:
        local = Path(candidate).expanduser()
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(local) if local.exists() else candidate,
                local_files_only=local_only,
                trust_remote_code=trust_remote_code,
            )
        except Exception as exc:  # OSError, ValueError, TypeError...: all mean "no usable tokenizer there"
            reasons.append(f"{candidate}: {' '.join(str(exc).split())[:160]}")
            continue
        if _tokenizes(tokenizer):
            return tokenizer
        # transformers 5 builds an empty tokenizer (no vocabulary) from a directory holding only
        # config.json rather than failing; packing text with it would make blocks of unknown tokens.
        reasons.append(f"{candidate}: no tokenizer files (an empty vocabulary)")
    if explicit:
        raise ModelNotFound(
            f"--tokenizer {explicit}: cannot load a tokenizer from it ({'; '.join(reasons)}); "
            f"give a directory holding tokenizer files, or a hub id."
        )
    where = f"{spec.path} has no tokenizer files" if spec.path else f"{spec.reference} is not in the Hugging Face cache"
    raise ModelNotFound(
        f"no tokenizer for {spec.reference}: {where}"
        f"{' and the hub is unreachable' if local_only else ''}; pass --tokenizer PATH "
        f"(a directory saved with tokenizer.save_pretrained, or a hub id)."
    )


def _tokenizes(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer has a vocabulary: plain English becomes known tokens."""
    try:
        ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot even encode English is as good as none
        return False
    unknown = getattr(tokenizer, "unk_token_id", None)
    return len(tokenizer) > 1 and bool(ids) and any(i != unknown for i in ids)


def check_vocabulary(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> None:
    """BadInput when the tokenizer makes ids that the model has no embedding for."""
    vocab = spec.config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise BadInput(
            f"the tokenizer has {len(tokenizer):,} tokens but {spec.reference}'s vocabulary has {vocab:,}: "
            f"ids past {vocab - 1} have no embedding; pass the model's own tokenizer with --tokenizer."
        )
