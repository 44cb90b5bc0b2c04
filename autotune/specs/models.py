"""Model references: from what a user types (hub id, gpt2-family name, local directory) to the
architecture a probe builds. Probes need the architecture, not the weights, so a directory holding
only `config.json` is a complete reference. Reads JSON only: no torch import here."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from autotune.vocabulary.errors import BadInput, ModelNotFound, quoted

# (Families whose positions are a learned table of the model's width: its size is held to the budget.)
from autotune.specs.shapes import _LEARNED_POSITIONS
from autotune.levers.tasks import task_fields
from autotune.vocabulary.units import format_size

# The GPT-2 family's architectures are public and fixed, so these names resolve offline.
# Values are those of the hub's config.json files (GPT2Config() defaults are gpt2 124M).
_GPT2_BASE = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_ctx": 1024,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
KNOWN_ARCHITECTURES: dict[str, dict] = {
    "gpt2": {**_GPT2_BASE, "n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-medium": {**_GPT2_BASE, "n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {**_GPT2_BASE, "n_layer": 36, "n_embd": 1280, "n_head": 20},
    "gpt2-xl": {**_GPT2_BASE, "n_layer": 48, "n_embd": 1600, "n_head": 25},
    "distilgpt2": {**_GPT2_BASE, "n_layer": 6, "n_embd": 768, "n_head": 12},
}
_ALIASES = {f"openai-community/{name}": name for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
_ALIASES["distilbert/distilgpt2"] = "distilgpt2"

_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len")
# A model's sizes under the names config.json files give them (GPT-2, BERT/Llama, T5/BART, DistilBERT,
# ALBERT): none may be zero or negative. The widths also size the embedding table.
_WIDTH_KEYS = ("embedding_size", "hidden_size", "n_embd", "d_model", "dim")
_SIZE_KEYS = (
    *_WIDTH_KEYS,
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
# The other sizes a model is built from (MLP widths, key/value heads, a head's width, the labels of a
# classification head): absent or null means the library's default; given, they are held to the same
# bounds as the sizes above (check_values).
_MORE_SIZE_KEYS = (
    "intermediate_size",
    "n_inner",
    "d_ff",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "num_key_value_heads",
    "num_kv_heads",
    "head_dim",
    "d_kv",
    "num_labels",
)
# The files from_pretrained reads a model's weights from: a directory without any holds only its architecture.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# The fewest tokens a vocabulary can have and still train something: the probe feeds random token
# ids in [0, vocab_size), so with one token every input and every label is the same.
MIN_VOCAB = 2
# No device holds this much (the largest cards hold a few hundred GiB, the largest hosts some TiB).
MAX_DEVICE_BYTES = 2**50
# The fewest bytes an embedding weight takes in any recipe (bf16 weights; fp32 otherwise): an
# embedding table is refused only when it cannot fit even so.
_MIN_WEIGHT_BYTES = 2


def shown_reference(reference: str) -> str:
    """A recorded model reference as a command shows it: a local directory under the working
    directory relative to it (`.venv/demo-gpt2`), anything else as recorded."""
    if not reference.startswith(os.sep):
        return reference
    try:
        relative = os.path.relpath(reference)
    except ValueError:
        return reference
    return reference if relative.startswith("..") else relative


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its architecture (config.json contents) and where it came from."""

    reference: str  # what the user typed
    config: dict  # config.json contents
    source: str  # 'local', 'hf-cache', 'hub' or 'builtin'
    path: str | None = None  # local directory or cached snapshot holding config.json (and maybe weights)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "?"))

    @property
    def recorded(self) -> str:  # (shown_reference says it back relative to where a command runs)
        """The reference a study and its configs keep: a local directory's absolute path, so that
        `train`, `best.load_model` and a worker find it from any directory; else as typed."""
        return str(Path(self.reference).expanduser().resolve()) if self.source == "local" else self.reference

    @property
    def max_positions(self) -> int | None:
        for key in _MAX_POSITION_KEYS:
            value = self.config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def check_block_sizes(self, *block_sizes: int, flag: str = "--block-size") -> None:
        """Refuse block sizes above the model's maximum positions (the one home of this check)."""
        limit = self.max_positions
        too_long = [b for b in block_sizes if limit is not None and b > limit]
        if too_long:
            raise BadInput(
                f"{flag} {','.join(map(str, too_long))} is above {self.reference}'s maximum of {limit} "
                f"positions; use at most {limit}."
            )

    def task_fields(
        self, *, task: str | None = None, target_length: int | None = None, num_labels: int | None = None
    ) -> dict:
        """The recipe fields of a config of this model, checked (autotune.levers.tasks.task_fields)."""
        return task_fields(
            self.config,
            self.reference,
            task=task,
            target_length=target_length,
            num_labels=num_labels,
            max_positions=self.max_positions,
        )

    def check_usable(self, trust_remote_code: bool = False, *, budget_bytes: int | None = None) -> None:
        """Refuse what can be told of the model from its config.json alone, before any process
        starts: no vocabulary (not a language model), shapes nothing can train (check_shapes), or
        its own code without leave to run it."""
        if self.config.get("vocab_size") is None:
            raise ModelNotFound(
                f"--model {self.reference}: its config has no vocab_size; is it a language model "
                f"(text in, tokens or labels out)?"
            )
        self.check_shapes(budget_bytes)
        if self.needs_remote_code and not trust_remote_code:
            raise BadInput(
                f"--model {self.reference} brings its own code (auto_map in its config.json); pass "
                f"--trust-remote-code to allow it to run, or choose another model."
            )

    def check_values(self) -> None:
        """Refuse a config.json size no model can be built from (the one home of this check: run where
        a config is read, resolve_model, and again by check_shapes). Every size of _SIZE_KEYS,
        _MAX_POSITION_KEYS, _MORE_SIZE_KEYS and vocab_size that the config gives (null: the
        library's default) must be:

        - a whole number: `"2"`, 2.0 or true would reach transformers only in the probe's child,
          which refuses it there (an error result, a study written) or builds something else;
        - at least 1 (vocab_size: MIN_VOCAB): a model of no layers, width or positions trains nothing,
          and transformers builds some of them without complaint (n_positions 0 fails at the first step);
        - small enough that what it sizes can exist: the size x the model's width x 2 bytes (one
          vector of the width for each position, token, label or layer, in bf16, the smallest any
          recipe keeps weights in; a width x itself) at most MAX_DEVICE_BYTES (1 PiB). The budget
          is check_shapes' to apply."""
        name = f"--model {self.reference}"
        given = [
            (key, self.config.get(key))
            for key in (*_SIZE_KEYS, *_MAX_POSITION_KEYS, *_MORE_SIZE_KEYS, "vocab_size")
            if self.config.get(key) is not None
        ]
        for key, value in given:
            if not _whole(value):
                typed = str(value).strip() if isinstance(value, str) else ""
                fix = (
                    f"write it as a number ({typed}), without quotes,"
                    if typed.isascii() and typed.isdigit()
                    else f"give {key} as a whole number"
                )
                raise BadInput(
                    f"{name}: its config.json has {key} {quoted(value)}, not a whole number; {fix} in the config."
                )
            if key == "vocab_size" and value < MIN_VOCAB:
                raise BadInput(
                    f"{name}: its config.json has vocab_size {value}; training needs at least {MIN_VOCAB} "
                    f"tokens (the probe feeds random token ids below vocab_size, so with {value} there is "
                    f"nothing to predict): give the model's real vocabulary size."
                )
            if value < 1:
                raise BadInput(
                    f"{name}: its config.json has {key} {value}; a model needs at least 1, so this one "
                    f"trains nothing: fix {key} in the config."
                )
        sizes = [(key, value) for key, value in given if _whole(value)]  # (all of them, checked above)
        width_key, width = self._width() or ("", 1)
        for key, value in sizes:
            table = value * (value if key == width_key else width) * _MIN_WEIGHT_BYTES
            if table > MAX_DEVICE_BYTES:
                raise BadInput(
                    self._too_large(
                        key,
                        value,
                        width_key or key,
                        value if key == width_key else width,
                        table,
                        "any device holds (1 PiB)",
                    )
                )

    def check_shapes(self, budget_bytes: int | None = None, *, num_labels: int | None = None) -> None:
        """Refuse a config.json whose shapes no probe should build (the one home of this check):
        sizes check_values refuses, and a table of vectors of the model's width that cannot fit in
        `budget_bytes` where a budget is given: the token embedding (vocab_size), a learned
        position embedding (n_positions, max_position_embeddings: the GPT-2 and BERT families),
        and a classification head of `num_labels` (--num-labels). A probe would otherwise try to
        allocate it (terabytes, for a mistyped size) before any budget applies."""
        self.check_values()
        if num_labels is not None and (not _whole(num_labels) or num_labels < 1):
            raise BadInput(f"--num-labels must be a whole number of at least 1 (got {num_labels!r}).")
        width_key, width = self._width() or ("", 1)
        tables = [("vocab_size", self.config["vocab_size"])] if self.config.get("vocab_size") is not None else []
        if self.model_type in _LEARNED_POSITIONS and self.max_positions is not None:
            tables.append(
                (next(k for k in _MAX_POSITION_KEYS if self.config.get(k) == self.max_positions), self.max_positions)
            )
        if num_labels is not None:
            tables.append(("--num-labels", num_labels))
        limit = MAX_DEVICE_BYTES if budget_bytes is None else min(budget_bytes, MAX_DEVICE_BYTES)
        by_budget = limit < MAX_DEVICE_BYTES
        for key, size in tables:
            table = size * width * _MIN_WEIGHT_BYTES
            if table > limit:
                where = f"the --gpu-budget {format_size(limit)}" if by_budget else "any device holds (1 PiB)"
                raise BadInput(self._too_large(key, size, width_key, width, table, where, budget=by_budget))

    def _width(self) -> tuple[str, int] | None:
        """The config's narrowest width (key, value) among _WIDTH_KEYS, None without one."""
        widths: list[tuple[str, int]] = [
            (key, value) for key in _WIDTH_KEYS if _whole(value := self.config.get(key)) and value > 0
        ]
        return min(widths, key=lambda item: item[1]) if widths else None

    def _too_large(
        self, key: str, size: int, width_key: str, width: int, table: int, where: str, budget: bool = False
    ) -> str:
        """The one line for a size whose table of `width`-wide vectors (`table` bytes) is more than `where`."""
        what = {"vocab_size": "its embedding table", "--num-labels": "its classification head"}.get(
            key,
            "its position table"
            if key in _MAX_POSITION_KEYS and self.model_type in _LEARNED_POSITIONS
            else f"{key} vectors of its width",
        )
        shape = f"{key} {size:,} x {width_key} {width:,}" if width_key else f"{key} {size:,}"
        fix = (
            "give the number of labels your data has"
            if key == "--num-labels"
            else f"check {key}{f' and {width_key}' if width_key and width_key != key else ''} in its config.json"
        )
        return (
            f"--model {self.reference}: {what} alone ({shape}) needs at least {format_size(table)}, more than "
            f"{where}; {fix}" + (", or give a larger --gpu-budget." if budget else ".")
        )

    @property
    def fingerprint(self) -> str:
        """Hash of the architecture, so a stored probe is reused only for the same model shape."""
        ignored = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}
        canonical = json.dumps({k: v for k, v in self.config.items() if k not in ignored}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def needs_remote_code(self) -> bool:
        return "auto_map" in self.config

    def hf_config(self, trust_remote_code: bool = False):
        """The transformers config: read from the model's directory where there is one (so that
        its own code can load when allowed), else built from the architecture alone."""
        from transformers import AutoConfig

        if self.path and (trust_remote_code or not self.needs_remote_code):
            return AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        fields = dict(self.config)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _whole(value: object) -> TypeGuard[int]:
    """A whole number as config.json and Python give one (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _read_config(path: Path) -> dict:
    """A config.json's contents, checked enough to be read by the rest: a JSON object of UTF-8 text
    with a model_type, its `architectures` a list of class names (one name alone becomes a list of
    one, as its writer meant)."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelNotFound(
            f"--model: cannot read {path}: it is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"position {exc.start}); it must be a model's config.json, saved as UTF-8."
        ) from None
    except (OSError, ValueError, RecursionError) as exc:  # (json.JSONDecodeError is a ValueError)
        raise ModelNotFound(f"--model: cannot read {path} ({exc}); it must be a model's config.json.") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelNotFound(f"--model: {path} has no 'model_type'; it must be a transformers config.json.")
    architectures = data.get("architectures")
    if isinstance(architectures, str):
        data["architectures"] = [architectures]
    elif architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        raise ModelNotFound(
            f"--model: {path} has 'architectures' {json.dumps(architectures)[:80]}; it must be a list "
            f'of class names, e.g. ["GPT2LMHeadModel"].'
        )
    return data


def _from_hf_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id that is not a valid repo name is simply not in the cache
        return None
    return Path(found) if isinstance(found, str) else None


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection attempt, so that an offline machine fails in seconds rather than after
    huggingface_hub's retries with back-off (about 25 s)."""
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(repo_id: str) -> Path | None:
    if _offline() or "/" not in repo_id and not repo_id.replace("-", "").replace("_", "").isalnum():
        return None
    if not _hub_reachable():
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "config.json", etag_timeout=5))
    except Exception:  # no network, no such repo, gated: all mean "not resolvable here"
        return None


def resolve_model(reference: str) -> ModelSpec:
    """Resolve a model reference: local directory, Hugging Face cache, known family, then the hub; its
    config.json's sizes checked where it is read (ModelSpec.check_values)."""
    spec = _resolve(reference)
    spec.check_values()
    return spec


def _resolve(reference: str) -> ModelSpec:
    reference = (reference or "").strip()
    if not reference:
        raise ModelNotFound("--model is empty; give a hub id (gpt2), or a local directory with a config.json.")
    local = Path(reference).expanduser()
    try:
        is_dir, is_file = local.is_dir(), local.is_file()
    except (OSError, ValueError) as exc:  # a name past the file system's limits (ENAMETOOLONG), a NUL byte
        shown = reference if len(reference) <= 60 else reference[:57] + "..."
        raise ModelNotFound(
            f"--model: {shown!r} cannot be a model: {getattr(exc, 'strerror', None) or exc}; give a "
            f"hub id (gpt2), or a local directory with a config.json."
        ) from None
    if is_dir:
        config_path = local / "config.json"
        if not config_path.is_file():
            raise ModelNotFound(f"--model: directory {local} has no config.json; point it at a model directory.")
        return ModelSpec(reference, _read_config(config_path), "local", str(local.resolve()))
    if is_file and local.name.endswith(".json"):
        return ModelSpec(reference, _read_config(local), "local", str(local.resolve().parent))

    repo_id = reference
    cached = _from_hf_cache(repo_id) or _from_hf_cache(_reverse_alias(repo_id))
    if cached:
        return ModelSpec(reference, _read_config(cached), "hf-cache", str(cached.parent))
    builtin = KNOWN_ARCHITECTURES.get(_ALIASES.get(repo_id, repo_id))
    if builtin is not None:
        return ModelSpec(reference, dict(builtin), "builtin", None)
    downloaded = _from_hub(repo_id)
    if downloaded:
        return ModelSpec(reference, _read_config(downloaded), "hub", str(downloaded.parent))
    raise ModelNotFound(
        f"--model: cannot resolve {reference!r}: not a local directory, not in the Hugging Face cache, "
        f"and the hub is unreachable; pass a directory containing its config.json "
        f"(offline, {', '.join(KNOWN_ARCHITECTURES)} are known)."
    )


def _reverse_alias(name: str) -> str:
    for full, short in _ALIASES.items():
        if short == name:
            return full
    return name
