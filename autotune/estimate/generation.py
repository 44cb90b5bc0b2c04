"""What transformers' `generate` reads of its tensors' values, answered for the trace.

On fake tensors a value read (`.item()`, `bool(tensor)`, a tensor used as a slice bound) has no
answer: fake tensors have shapes, not values. `generate` reads a few to steer its loop: whether the
inputs hold negative ids, whether every sequence has finished, how long the longest beam grew. The
probe's generation (autotune.probe.phases) makes each answer known before it runs: its input ids
are drawn from the vocabulary, and it asks for the whole length (`min_length == max_length`), so
no sequence stops before `max_length` and every beam grows to it. `GenerationReads` gives those
answers, found by the function and the source line that reads (transformers 5's generation
utilities). A read it does not know is never guessed: it raises `UnansweredRead`, and the estimate
says that its generate phase was not estimated, and why.

Imported by the trace child only (it reads frames of a running generate).
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class UnansweredRead(Exception):
    """`generate` read a tensor's value where the trace does not know the real run's answer."""


def _finished(locals_: dict, max_length: int) -> bool:
    # StopCheck.__call__(unfinished_sequences, tokens, length): all sequences end together, at max_length.
    length = locals_.get("length")
    if not isinstance(length, int):
        length = locals_["input_ids"].shape[-1]
    return length >= max_length


# (function, a piece of the reading line) -> the real run's answer, from the frame's locals and
# the probe's max_length. In the order generate meets them.
_RULES: tuple[tuple[str, str, Callable[[dict, int], Any]], ...] = (
    # _get_logits_processor: has_encoder_input_ids = ... not (encoder_input_ids < 0).any()
    ("_get_logits_processor", "(encoder_input_ids < 0).any()", lambda f, n: False),
    # greedy: StopCheck: bool(unfinished_sequences.max() == 0)
    ("__call__", "unfinished_sequences.max() == 0", _finished),
    ("_sample", "unfinished_sequences.max() == 0", _finished),
    # beam search: this_peer_finished = not self._beam_search_has_unfinished_sequences(...)
    ("_beam_search", "_beam_search_has_unfinished_sequences", lambda f, n: f["cur_len"] < f["max_length"]),
    # beam search, after the loop: crop to the longest beam, which is every beam, at max_length
    ("_beam_search", ":output_length]", lambda f, n: f["max_length"]),
    ("_beam_search", ":max_generated_length]", lambda f, n: f["max_length"] - f["decoder_prompt_len"]),
)


def _reader() -> FrameType:
    """The frame that read the value: the first outside torch, this package and dispatch modes."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith((_TORCH_DIR, _HERE)) or frame.f_code.co_name == "__torch_dispatch__"
    ):
        frame = frame.f_back
    return frame


class GenerationReads:
    """Answers the value reads of the probe's `generate`, which runs to `max_length` tokens."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def answer(self, tensor: torch.Tensor) -> bool | int:
        """The value the real run reads from `tensor` here; UnansweredRead where it is not known."""
        frame = _reader()
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno).strip()
        where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name}: {line[:120]})"
        for function, piece, rule in _RULES:
            if code.co_name == function and piece in line:
                # Before Python 3.13 frame.f_locals is a dict the frame keeps, holding every local as
                # it is now until the next read: it would keep tensors alive that the run lets go
                # (measured: a beam step's logits, 150 KiB on a tiny t5). Emptied at once, which
                # leaves the frame's own variables as they are. (3.13's is a live view: left alone.)
                snapshot = frame.f_locals
                try:
                    value = rule(snapshot, self.max_length)
                except (KeyError, AttributeError) as exc:  # another transformers: its loop names them otherwise
                    raise UnansweredRead(
                        f"generate reads a tensor's value at {where}, answered from its variables, which lack {exc}"
                    ) from None
                finally:
                    if type(snapshot) is dict:
                        snapshot.clear()
                return bool(value) if tensor.dtype == torch.bool else int(value)
        raise UnansweredRead(f"generate reads a tensor's value at {where}, which a trace on fake tensors cannot answer")
