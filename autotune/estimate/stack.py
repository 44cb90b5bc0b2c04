"""The library versions a predicted run uses, where they are not the installed ones, and what they
did differently in memory. The trace runs the installed libraries; a run on an older stack is
predicted by making them behave as the older ones did where that changes memory. Needed to hold
the estimator to measurements published over the years (benchmarks/published), and for a user whose
training machine runs an older bitsandbytes than the machine that predicts.

Each behaviour is a fact of the libraries' history, with where it changed:
- bitsandbytes before 0.43.2 kept each 4-bit layer's input A on its autograd context for a backward
  that never read it (`ctx.tensors = (A, B)` in MatMul4Bit; PR #1270, July 2024, "fix QLoRA mem bug:
  delete useless buffered activation"). A plain attribute, not a saved tensor: gradient
  checkpointing (non-reentrant) does not free it either.
- torch before 1.11 saved softmax's and log-softmax's input for backward beside the output, which
  alone the backward reads (pytorch#64000, fixed by #65242 for 1.11): every attention layer's
  scores, a language model's logits, held until backward.
- torch before 2.0 zeroed gradients in place by default (`zero_grad(set_to_none=False)`), and
  Trainer called `model.zero_grad()`: the gradients stayed allocated from one step to the next,
  through the next forward. Since 2.0 they are freed after each optimizer step.

Two more change what a step costs in time, not memory (the speed model, planner/speed.py and
planner/traffic.py, reads them; the published speed table sets them per row, `--stack` does not:
autotune's hand-off fixes both whatever the versions):
- transformers before 5.0 checkpointed with use_reentrant=True unless told otherwise (pinned by
  transformers#28538, January 2024, torch's own default before that; False since #43203): its
  recompute is a plain forward under no_grad, fewer ops for the host to launch. autotune's probes
  and hand-off pass use_reentrant=False.
- peft before 0.12.0 kept LoRA adapters in the base's dtype; since then in fp32 whatever the base
  (`autocast_adapter_dtype`, peft#1706), the adapters' input cast and read in fp32. LoRA code other
  than peft's (`lora`: torchtune's, NeMo AutoModel's) keeps them in the base's dtype too.

Torch-free: the estimator's parent reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from autotune.vocabulary.errors import BadInput

KEEPS_4BIT_INPUTS_BEFORE = "0.43.2"  # bitsandbytes
FREES_GRADS_FROM = "2.0"  # torch
FREES_SOFTMAX_INPUTS_FROM = "1.11"  # torch
NON_REENTRANT_FROM = "5.0"  # transformers
FP32_ADAPTERS_FROM = "0.12.0"  # peft
LIBRARIES = ("torch", "bitsandbytes")


def _older(version: str | None, than: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) < Version(than)
    except InvalidVersion:
        return False


@dataclass(frozen=True, slots=True)
class Stack:
    """Versions of the run's libraries (None: the installed one's behaviour)."""

    torch: str | None = None
    bitsandbytes: str | None = None
    transformers: str | None = None
    peft: str | None = None
    lora: str | None = None  # the LoRA code where it is not peft's (e.g. "torchtune")

    @property
    def keeps_4bit_inputs(self) -> bool:
        """Whether each 4-bit layer keeps its input until backward (bitsandbytes before 0.43.2)."""
        return _older(self.bitsandbytes, KEEPS_4BIT_INPUTS_BEFORE)

    @property
    def keeps_zeroed_grads(self) -> bool:
        """Whether the gradients stay allocated, zeroed, between optimizer steps (torch before 2.0)."""
        return _older(self.torch, FREES_GRADS_FROM)

    @property
    def keeps_softmax_inputs(self) -> bool:
        """Whether softmax and log-softmax keep their input until backward (torch before 1.11)."""
        return _older(self.torch, FREES_SOFTMAX_INPUTS_FROM)

    @property
    def reentrant_checkpointing(self) -> bool:
        """Whether checkpointing recomputes with use_reentrant=True (transformers before 5.0)."""
        return _older(self.transformers, NON_REENTRANT_FROM)

    @property
    def fp32_adapters(self) -> bool:
        """Whether LoRA adapters are fp32 whatever the base (peft from 0.12.0; not other LoRA code)."""
        return self.lora is None and not _older(self.peft, FP32_ADAPTERS_FROM)

    def differences(self) -> list[str]:
        """What this stack does differently from the installed libraries, one note each."""
        notes = []
        if self.keeps_4bit_inputs:
            notes.append(
                f"bitsandbytes {self.bitsandbytes}: each 4-bit layer keeps its input for backward "
                f"(before {KEEPS_4BIT_INPUTS_BEFORE})"
            )
        if self.keeps_softmax_inputs:
            notes.append(
                f"torch {self.torch}: softmax and log-softmax keep their input for backward "
                f"(before {FREES_SOFTMAX_INPUTS_FROM})"
            )
        if self.keeps_zeroed_grads:
            notes.append(
                f"torch {self.torch}: gradients zeroed in place, kept between steps (before {FREES_GRADS_FROM})"
            )
        if self.reentrant_checkpointing:
            notes.append(
                f"transformers {self.transformers}: checkpointing with use_reentrant=True, its recompute's "
                f"launches (before {NON_REENTRANT_FROM})"
            )
        if not self.fp32_adapters:
            notes.append(f"{self.lora or f'peft {self.peft}'}: LoRA adapters in the base's dtype (speed)")
        return notes

    def notes(self) -> list[str]:
        """The differences as an estimate's or a plan's notes."""
        return [f"predicted for {difference}" for difference in self.differences()]

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict | None) -> Stack:
        return cls(**(data or {}))

    @classmethod
    def parse(cls, text: str | None, flag: str = "--stack") -> Stack:
        """`torch=1.13,bitsandbytes=0.41.1` (either, or both) as a Stack; BadInput for anything else."""
        from packaging.version import InvalidVersion, Version

        if text is None or not text.strip():
            return cls()
        versions: dict[str, str] = {}
        for part in text.split(","):
            name, sep, version = part.strip().partition("=")
            name, version = name.strip().lower(), version.strip()
            if not sep or name not in LIBRARIES:
                raise BadInput(
                    f"{flag} {text!r}: give library=version pairs of {' and '.join(LIBRARIES)}, e.g. "
                    f"torch=1.13,bitsandbytes=0.41.1."
                )
            try:
                Version(version)
            except InvalidVersion:
                raise BadInput(f"{flag}: {version!r} is not a version of {name} (e.g. 1.13 or 0.41.1).") from None
            versions[name] = version
        return cls(**versions)
