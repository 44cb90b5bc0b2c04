"""The training tests' workspace: a tiny model, a corpus and a study chosen by a real CPU search
(made by the fixtures in tests/train/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STUDY = "tiny-cpu"
STUDY_BUDGET = 64 * 2**20


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: Path  # config.json, model.safetensors and tokenizer files
    corpus: Path  # ~460 KB of English prose
    small_eval: Path  # a few KB of it, for evaluation
    db: str  # SQLAlchemy URL holding the study
    study: str
