"""Training data for `autotune train`: from what a user types (a local file or a hub data set) to
blocks of token ids of the winning configuration's block size.

Loading is split in two so that a bad data set fails before anything expensive or lasting happens:
`load_text` reads and checks the raw text (needs only `datasets`, no torch); `pack_blocks`
tokenises and packs it into blocks once the block size is known (after a search, if one runs).
Packing follows the Hugging Face `run_clm.py` example: concatenate every text, cut into blocks of
`block_size` tokens, drop the remainder; labels are the input ids (the model shifts them).

Tasks that read more than the text (a seq2seq target, a classification label) name their columns
through `load_text(..., columns=...)`; `autotune.data.task_data` makes their examples.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.vocabulary.errors import DatasetError

# File extensions by the `datasets` builder that reads them. Compressed files (.gz, .bz2, .xz,
# .zst) are read by the same builders.
BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")
KNOWN = ".txt, .json, .jsonl, .csv, .tsv or .parquet"
DEFAULT_TEXT_COLUMN = "text"


@dataclass(frozen=True, slots=True)
class DatasetSource:
    """Where a data set comes from: local files through a builder, or a hub data set."""

    spec: str  # what the user typed
    kind: str  # 'file', 'directory' or 'hub'
    path: str  # builder name, directory or hub id for load_dataset
    data_files: str | None = None
    config: str | None = None  # hub configuration (e.g. wikitext-2-raw-v1)
    split: str = "train"
    builder_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(slots=True)
class TextData:
    """Raw text, checked: the rows of the training split (and of the evaluation split, if any) and
    the column that holds the text."""

    source: DatasetSource
    train: Any  # datasets.Dataset
    column: str
    eval: Any | None = None  # datasets.Dataset
    eval_fraction: float | None = None  # hold out this share of the packed blocks instead
    others: dict[str, str] = field(default_factory=dict)  # other columns a task reads, by role ('target', 'label')

    def describe(self) -> str:
        evaluation = ""
        if self.eval is not None:
            evaluation = f", evaluation {len(self.eval):,} rows"
        elif self.eval_fraction:
            evaluation = f", {self.eval_fraction:.0%} of the blocks held out for evaluation"
        rows = f"{len(self.train):,} row{'s' if len(self.train) != 1 else ''}"
        others = "".join(f", {role} in column {name!r}" for role, name in self.others.items())
        return f"{self.source.spec}: {rows}, text in column {self.column!r}{others}{evaluation}"


@dataclass(slots=True)
class Blocks:
    """Packed training (and evaluation) blocks."""

    train: Any  # datasets.Dataset with input_ids and labels
    eval: Any | None
    block_size: int
    tokens: int  # tokens of text, before the remainder was dropped

    def describe(self) -> str:
        evaluation = f", {len(self.eval):,} for evaluation" if self.eval is not None else ""
        return (
            f"{self.tokens:,} tokens packed into {len(self.train):,} training blocks of {self.block_size}{evaluation}"
        )


def parse_source(spec: str, *, flag: str = "--dataset") -> DatasetSource:
    """A local file or directory when the path exists; a path-like name that does not exist is a
    missing file; anything else is a hub data set `NAME[:CONFIG[:SPLIT]]`."""
    spec = (spec or "").strip()
    if not spec:
        raise DatasetError(f"{flag} is empty; give a text file (.txt, .jsonl, .csv, .parquet) or a hub data set name.")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not _holds_data_files(path):
            raise DatasetError(
                f"{flag} {spec}: the directory holds no {KNOWN} file; give a data file, or a directory of such files."
            )
        return DatasetSource(spec, "directory", str(path.resolve()))
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    extension = suffixes[-1] if suffixes else ""
    looks_like_file = path.is_file() or extension in BUILDERS or "/" in spec or "\\" in spec or spec.startswith(".")
    if path.is_file():
        if path.stat().st_size == 0:
            raise DatasetError(f"{flag} {spec}: the file is empty; give a file with some text.")
        builder = BUILDERS.get(extension)
        if builder is None:
            raise DatasetError(
                f"{flag} {spec}: cannot read files ending in {extension or '(no extension)'!r}; "
                f"give a {KNOWN} file, or a hub data set name."
            )
        kwargs: tuple[tuple[str, Any], ...] = ()
        if builder == "text":
            kwargs = (("keep_linebreaks", True),)  # as run_clm.py: lines keep their newline
        elif extension == ".tsv":
            kwargs = (("sep", "\t"),)
        return DatasetSource(spec, "file", builder, data_files=str(path.resolve()), builder_kwargs=kwargs)
    if looks_like_file and not _looks_like_hub_id(spec):
        raise DatasetError(
            f"{flag} {spec}: no such file or directory; give an existing {KNOWN} file, or a hub data set name."
        )
    name, _, rest = spec.partition(":")
    config, _, split = rest.partition(":")
    if ":" in split:
        raise DatasetError(
            f"{flag} {spec}: write a hub data set as NAME, NAME:CONFIG or NAME:CONFIG:SPLIT "
            f"(e.g. wikitext:wikitext-2-raw-v1:train)."
        )
    return DatasetSource(spec, "hub", name, config=config or None, split=split or "train")


def _holds_data_files(directory: Path) -> bool:
    """Whether `datasets` finds a data file of a known kind in `directory` (as it does, skipping
    hidden files and folders and those starting with '__')."""
    for path in directory.rglob("*"):
        if any(part.startswith((".", "__")) for part in path.relative_to(directory).parts) or not path.is_file():
            continue
        suffixes = [s.lower() for s in path.suffixes]
        if suffixes and suffixes[-1] in _COMPRESSION:
            suffixes = suffixes[:-1]
        if suffixes and suffixes[-1] in BUILDERS:
            return True
    return False


def _looks_like_hub_id(spec: str) -> bool:
    # 'owner/name' or 'owner/name:config' is a hub id even though it contains a slash.
    name = spec.split(":", 1)[0]
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith(".") and Path(name).suffix.lower() not in BUILDERS


def _load(source: DatasetSource):
    """The DatasetDict of a source; DatasetError with the reason when it cannot be read."""
    import datasets

    if not sys.stderr.isatty():
        datasets.disable_progress_bars()  # one bar per file and map is noise in a log
    try:
        with _held_logs():
            if source.kind == "file":
                return datasets.load_dataset(source.path, data_files=source.data_files, **dict(source.builder_kwargs))
            if source.kind == "directory":
                return datasets.load_dataset(source.path)
            with _hub_access():
                return datasets.load_dataset(source.path, source.config)
    except DatasetError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ArrowInvalid, DatasetNotFoundError, ...)
        reason = _root_reason(exc)
        if source.kind == "hub":
            raise DatasetError(
                f"--dataset {source.spec}: cannot load it from the hub or the local cache ({reason}); "
                f"offline, give a local {KNOWN} file."
            ) from None
        hint = _FORMAT_HINTS.get(source.path, "") if source.kind == "file" else ""
        raise DatasetError(f"--dataset {source.spec}: cannot read it ({reason}){hint}.") from None


# What a file of each builder must hold, said when one cannot be read.
_FORMAT_HINTS = {
    "json": "; a .json or .jsonl file holds JSON objects, one per line (or one list of them)",
    "csv": "; give comma- (or, for .tsv, tab-) separated values with a header row",
    "text": "; give UTF-8 text",
}


@contextlib.contextmanager
def _held_logs() -> Iterator[None]:
    """Hold back what `datasets` logs and warns while it loads: a file it cannot read is logged
    ("Failed to load JSON from file ...") before the error is raised, and the error becomes our one
    line. After a load that succeeds, what was held is passed on."""
    logger = logging.getLogger("datasets")
    handlers, propagate = logger.handlers[:], logger.propagate
    held = _Holder()
    logger.handlers, logger.propagate = [held], False
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("default")
            yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    for record in held.records:
        logger.handle(record)
    for warning in warned:  # (through the filters in force outside)
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


class _Holder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _root_reason(exc: BaseException) -> str:
    """The message of the first error under datasets' wrappers ("An error occurred while
    generating the dataset" says nothing a user can act on): the parser's own complaint, rather
    than the fallback parser's (pandas' "Trailing data", after pyarrow's "JSON parse error")."""
    while isinstance(exc, _wrappers()) and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _wrappers() -> tuple[type[BaseException], ...]:
    from datasets.exceptions import DatasetGenerationError

    return (DatasetGenerationError,)


@contextlib.contextmanager
def _hub_access() -> Iterator[None]:
    """Offline machines answer from the local cache at once instead of after minutes of retries."""
    import datasets

    from autotune.specs.models import _hub_reachable, _offline

    if _offline() or _hub_reachable():
        yield
        return
    previous = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = previous


def _split(loaded, source: DatasetSource, split: str, *, flag: str):
    if split not in loaded:
        raise DatasetError(
            f"{flag}: {source.spec} has no split {split!r} (it has: {', '.join(loaded)}); "
            f"name one of those{', a file, or a share like 5%' if flag == '--eval-split' else ''}."
        )
    return loaded[split]


def text_column(
    dataset,
    requested: str | None,
    spec: str,
    *,
    flag: str = "--text-column",
    names: tuple[str, ...] = (DEFAULT_TEXT_COLUMN,),
    role: str = "text",
    taken: tuple[str, ...] = (),
    only: bool = True,
) -> str:
    """The column holding `role`'s text: `requested`, else the first of `names` the data set has,
    else (when `only`) its only text column that another role has not `taken`."""
    strings = [
        name
        for name, feature in dataset.features.items()
        if getattr(feature, "dtype", None) in ("string", "large_string")
    ]
    columns = ", ".join(dataset.column_names) or "none"
    if requested is not None:
        if requested not in dataset.column_names:
            raise DatasetError(f"{flag} {requested!r}: {spec} has no such column (it has: {columns}).")
        if requested not in strings:
            raise DatasetError(
                f"{flag} {requested!r}: that column of {spec} does not hold text; "
                f"give one of the text columns ({', '.join(strings) or 'none'})."
            )
        if requested in taken:
            raise DatasetError(
                f"{flag} {requested!r}: that column of {spec} is already read for another role; "
                f"give a column of its own."
            )
        return requested
    free = [name for name in strings if name not in taken]
    for name in names:
        if name in free:
            return name
    if only and len(free) == 1:
        return free[0]
    wanted = " or ".join(repr(name) for name in names)
    if not free or not only:
        named = f", or name it with {flag}" if free else ""
        raise DatasetError(
            f"--dataset {spec}: no {role} column (columns: {columns}); give a data set with a {wanted} column{named}."
        )
    raise DatasetError(
        f"--dataset {spec}: no {wanted} column and several text columns ({', '.join(free)}); choose one with {flag}."
    )


def load_text(
    spec: str,
    *,
    column: str | None = None,
    eval_split: str | None = None,
    columns: Callable[[Any], dict[str, str]] | None = None,
) -> TextData:
    """Read and check a data set's raw text: it exists, has a text column, and is not empty.
    `eval_split`: a split name of the same data set, a file, or a share of the blocks ('5%').
    `columns(train split)` names the columns a task reads by role, the text as 'text' (and then
    `column` is not used); by default the text column alone. The evaluation split must have them all."""
    source = parse_source(spec)
    loaded = _load(source)
    train = _split(loaded, source, source.split, flag="--dataset")
    roles = columns(train) if columns is not None else {"text": text_column(train, column, spec)}
    name = roles.pop("text")
    if len(train) == 0 or not _any_text(train, name):
        raise DatasetError(f"--dataset {spec}: no text in column {name!r}; give a data set with some text.")
    data = TextData(source=source, train=train, column=name, others=roles)
    if eval_split:
        eval_split = eval_split.strip()
        if eval_split.endswith("%"):
            try:
                fraction = float(eval_split[:-1]) / 100
            except ValueError:
                fraction = -1.0
            if not 0 < fraction < 1:
                raise DatasetError(
                    f"--eval-split {eval_split!r}: give a share between 0% and 100% (like 5%), a split name or a file."
                )
            if fraction > MAX_EVAL_FRACTION:
                raise DatasetError(
                    f"--eval-split {eval_split!r}: that holds out more of the blocks than it trains on; give "
                    f"a share of at most {MAX_EVAL_FRACTION:.0%} (like 5%), a split name or a file."
                )
            data.eval_fraction = fraction
        elif Path(eval_split).expanduser().exists() or source.kind == "file":
            other = parse_source(eval_split, flag="--eval-split")
            if other.kind == "hub":
                # A single local file has only a 'train' split: anything else must be another file.
                raise DatasetError(
                    f"--eval-split {eval_split!r}: {spec} is one file with no other splits; "
                    f"give another file, or a share of the blocks like 5%."
                )
            data.eval = _with_columns(
                _split(_load(other), other, other.split, flag="--eval-split"), eval_split, (name, *roles.values())
            )
        else:
            data.eval = _with_columns(
                _split(loaded, source, eval_split, flag="--eval-split"), eval_split, (name, *roles.values())
            )
    return data


# The largest share of the blocks --eval-split may hold out: more would train on less than it evaluates.
MAX_EVAL_FRACTION = 0.5


def _any_text(dataset, column: str, batch: int = 10_000) -> bool:
    """Whether any row of `column` holds more than white space; reads batch by batch and stops at
    the first that does (a data set of blank rows is refused before anything is searched)."""
    for start in range(0, len(dataset), batch):
        if any(isinstance(text, str) and text.strip() for text in dataset[start : start + batch][column]):
            return True
    return False


def _with_columns(evaluation, eval_split: str, needed: tuple[str, ...]):
    """The evaluation split, when it has every column the training data is read from."""
    for column in needed:
        if column not in evaluation.column_names:
            raise DatasetError(
                f"--eval-split {eval_split}: no column {column!r} as in the training data "
                f"(it has: {', '.join(evaluation.column_names)})."
            )
    return evaluation


@contextlib.contextmanager
def _quiet_tokenizer() -> Iterator[None]:
    # Whole documents are tokenised before packing, so "longer than the maximum sequence length"
    # warnings are expected and meaningless here (run_clm.py silences them the same way).
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _pack(dataset, tokenizer, column: str, block_size: int):
    def tokenize(batch):
        with _quiet_tokenizer():
            return {"input_ids": tokenizer(batch[column], add_special_tokens=False)["input_ids"]}

    def group(batch):
        ids = [token for seq in batch["input_ids"] for token in seq]
        usable = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        # The all-ones mask run_clm.py's group_texts keeps (the tokenizer's) and TRL's collator makes:
        # what the probes' packed batches carry (autotune.probe.step.synthetic_batch).
        return {
            "input_ids": blocks,
            "attention_mask": [[1] * block_size for _ in blocks],
            "labels": [list(b) for b in blocks],
        }

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="Tokenizing")
    tokens = sum(len(ids) for ids in tokenized["input_ids"])
    # Large batches of texts per group, so that little is lost at each batch's remainder.
    packed = tokenized.map(group, batched=True, batch_size=1000, desc=f"Packing into blocks of {block_size}")
    return packed, tokens


def pack_blocks(data: TextData, tokenizer, block_size: int, *, seed: int = 42) -> Blocks:
    """Tokenise and pack into blocks; DatasetError when there is not one full block of text."""
    train, tokens = _pack(data.train, tokenizer, data.column, block_size)
    if len(train) == 0:
        raise DatasetError(
            f"--dataset {data.source.spec}: {tokens:,} tokens of text, fewer than one block of "
            f"{block_size}; give more text."
        )
    evaluation = None
    if data.eval is not None:
        evaluation, eval_tokens = _pack(data.eval, tokenizer, data.column, block_size)
        if len(evaluation) == 0:
            raise DatasetError(
                f"--eval-split: {eval_tokens:,} tokens of text, fewer than one block of {block_size}; "
                f"give more evaluation text."
            )
    elif data.eval_fraction:
        if len(train) < 2:
            raise DatasetError(
                f"--eval-split {data.eval_fraction:.0%}: only one block of {block_size} tokens; "
                f"give more text or no --eval-split."
            )
        held = math.ceil(len(train) * data.eval_fraction)
        if held >= len(train):
            raise DatasetError(
                f"--eval-split {data.eval_fraction:.2%}: {len(train)} blocks of {block_size} tokens "
                f"leave none to train on; give a smaller share, or more text."
            )
        parts = train.train_test_split(test_size=held, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    return Blocks(train=train, eval=evaluation, block_size=block_size, tokens=tokens)
