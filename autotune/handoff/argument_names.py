"""TrainingArguments' names as the installed transformers has them: a hand-off names each lever
the way the transformers that will run it reads it. Read without importing transformers (its
version, or its source), so that `autotune best` stays fast; every function is cached."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from autotune.levers.lengths import DEFAULT_SAMPLING

# TrainingArguments' names for activation checkpointing: transformers 5.23 renamed
# gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); the old names still parse
# (the example scripts' --gradient_checkpointing included) but warn "deprecated and will be removed in v6".
_CHECKPOINTING_RENAMED_IN = (5, 23)


@functools.cache
def checkpointing_argument_names() -> tuple[str, str]:
    """(flag, kwargs) names of activation checkpointing in the installed transformers' TrainingArguments,
    read from its version (importlib.metadata: transformers is not imported, so `autotune best` stays
    fast); the old names when transformers is not installed here (every transformers 5 takes them)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "gradient_checkpointing", "gradient_checkpointing_kwargs"
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers >= _CHECKPOINTING_RENAMED_IN:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def sampling_arguments(sampling: str) -> dict:
    """TrainingArguments' keys for the run's sampler (autotune.levers.lengths.SAMPLINGS): `train_sampling_strategy`
    where the installed transformers has it (its train-sampler unification, 2026), else the older
    `group_by_length: true`; none for random sampling, every version's default."""
    if sampling == DEFAULT_SAMPLING:
        return {}
    return {"train_sampling_strategy": sampling} if _has_sampling_strategy() else {"group_by_length": True}


@functools.lru_cache(maxsize=1)
def _has_sampling_strategy() -> bool:
    # Read from the installed source rather than imported: `autotune best` does not import transformers.
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return True
    source = Path(spec.origin).with_name("training_args.py")
    return source.exists() and "train_sampling_strategy" in source.read_text()
