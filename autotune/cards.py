"""Common NVIDIA cards as data: memory, peak FLOP/s, bandwidth and features, for `autotune plan
--gpu NAME` (a card the user does not have) and for MFU on the card a probe runs on
(`autotune.probe.devices.peak_flops`, matched on CUDA's device name).

Torch-free: the planner and the CLI read this table before any probe starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autotune.errors import BadInput

# CUDA context with its loaded kernels, outside PyTorch's allocator: the figure the estimator
# assumes (autotune.estimate.result.CUDA_CONTEXT_BYTES; 0.3-0.7 GiB by driver, card and libraries).
# cuBLAS's workspaces are not in it: they come from the caching allocator, and the estimator counts
# them as allocated memory (CUBLAS_WORKSPACE_BYTES).
DEFAULT_CONTEXT_BYTES = 500 * 2**20
# Compute capability from which a card has bf16, TF32 tensor cores and flash-attention kernels.
AMPERE = (8, 0)


def _gib(gib: float) -> int:
    """Bytes in a total PyTorch printed in GiB with two decimals (exact to about 5 MiB)."""
    return round(gib * 2**30)


@dataclass(frozen=True, slots=True)
class Card:
    """One card as a training run sees it.

    `memory_bytes` is what `torch.cuda.get_device_properties().total_memory` reports: less than the
    GB of the data sheet (the driver, ECC and the firmware keep some), and it varies by about
    0.1 GiB with the driver. `peak_flops` is dense (no sparsity) by precision, from the vendor's
    data sheet: fp32 is plain FP32 (no TF32: PyTorch leaves it off by default), tf32 the TF32
    tensor cores', bf16/fp16 the tensor cores' with fp32 accumulation (what PyTorch uses; GeForce
    cards do half the fp16-accumulate figure). A precision a card lacks is absent.
    """

    name: str                             # display name
    aliases: tuple[str, ...]              # lower-case names `--gpu` accepts; the first is the card's short name
    memory_bytes: int                     # total memory CUDA reports (bytes)
    peak_flops: dict[str, float] = field(hash=False)  # dense FLOP/s by precision: fp32, tf32, bf16, fp16
    memory_bandwidth: float               # bytes/s, from the data sheet
    compute_capability: tuple[int, int]
    name_fragments: tuple[str, ...]       # lower-case pieces of CUDA's device name(s) for this card
    context_bytes: int = DEFAULT_CONTEXT_BYTES

    @property
    def short_name(self) -> str:
        return self.aliases[0]

    @property
    def has_bf16(self) -> bool:
        return self.compute_capability >= AMPERE

    @property
    def has_tf32(self) -> bool:
        return self.compute_capability >= AMPERE

    @property
    def has_flash_attention(self) -> bool:
        """flash_attention_2 needs Ampere or newer (compute capability 8.0); Volta and Turing lack it."""
        return self.compute_capability >= AMPERE


def _peaks(bf16: float | None, fp32: float, tf32: float | None, fp16: float | None = None) -> dict[str, float]:
    """Peak FLOP/s by precision, each in FLOP/s; fp16 is bf16's unless given (cards before Ampere
    have fp16 tensor cores and no bf16)."""
    table = {"fp32": fp32}
    if bf16 is not None:
        table["bf16"] = bf16
    half = fp16 if fp16 is not None else bf16
    if half is not None:
        table["fp16"] = half
    if tf32 is not None:
        table["tf32"] = tf32
    return table


# Memory totals are what PyTorch reports on the card (its out-of-memory message, "GPU 0 has a total
# capacity of ..."): the usable total CUDA sees, less than the marketing GB. Peaks from the vendor's
# data sheets, dense; bandwidth from the same sheets. Numbers that autotune.probe.devices had before
# this table are kept as they were. Columns: display name, aliases, memory, peaks (bf16, fp32, tf32),
# bandwidth, compute capability, CUDA device-name fragments.
CARDS: tuple[Card, ...] = (
    Card("NVIDIA H100 80GB HBM3 (SXM)", ("h100", "h100-sxm", "h100-sxm5", "h100-80gb", "h100-hbm3"),
         85_029_158_912, _peaks(989e12, 67e12, 495e12), 3.35e12, (9, 0), ("h100",)),
    Card("NVIDIA H100 PCIe", ("h100-pcie", "h100-pcie-80gb"),
         85_029_158_912, _peaks(756e12, 51e12, 378e12), 2.0e12, (9, 0), ("h100 pcie",)),
    Card("NVIDIA H100 NVL", ("h100-nvl", "h100-94gb"),
         _gib(93.00), _peaks(835e12, 60e12, 417e12), 3.9e12, (9, 0), ("h100 nvl",)),
    Card("NVIDIA H200 (SXM)", ("h200", "h200-sxm", "h200-141gb"),
         _gib(139.80), _peaks(989e12, 67e12, 495e12), 4.8e12, (9, 0), ("h200",)),
    Card("NVIDIA GH200 (96GB HBM3)", ("gh200", "gh200-96gb", "grace-hopper"),
         _gib(94.50), _peaks(989e12, 67e12, 495e12), 4.0e12, (9, 0), ("gh200",)),
    Card("NVIDIA B200", ("b200", "b200-sxm", "b200-180gb"),
         _gib(178.35), _peaks(2250e12, 75e12, 1100e12), 8.0e12, (10, 0), ("b200",)),
    Card("NVIDIA A100 80GB", ("a100", "a100-80gb", "a100-sxm", "a100-sxm4-80gb", "a100-pcie-80gb"),
         _gib(79.15), _peaks(312e12, 19.5e12, 156e12), 2.039e12, (8, 0), ("a100-sxm4-80gb", "a100 80gb")),
    Card("NVIDIA A100 40GB", ("a100-40gb", "a100-sxm4-40gb", "a100-pcie-40gb"),
         _gib(39.50), _peaks(312e12, 19.5e12, 156e12), 1.555e12, (8, 0), ("a100",)),
    Card("NVIDIA A10G", ("a10g",),
         _gib(21.99), _peaks(125e12, 31.2e12, 62.5e12), 600e9, (8, 6), ("a10g",)),
    Card("NVIDIA A10", ("a10",),
         _gib(21.99), _peaks(125e12, 31.2e12, 62.5e12), 600e9, (8, 6), ("a10",)),
    Card("NVIDIA L40S", ("l40s",),
         _gib(44.40), _peaks(362e12, 91.6e12, 183e12), 864e9, (8, 9), ("l40s",)),
    Card("NVIDIA L4", ("l4",),
         _gib(22.05), _peaks(121e12, 30.3e12, 60e12), 300e9, (8, 9), ("l4",)),
    Card("NVIDIA GeForce RTX 4090", ("rtx4090", "rtx-4090", "4090", "geforce-rtx-4090"),
         25_386_352_640, _peaks(165e12, 82.6e12, 82.6e12), 1008e9, (8, 9), ("rtx 4090",)),
    Card("NVIDIA GeForce RTX 3090", ("rtx3090", "rtx-3090", "3090", "geforce-rtx-3090"),
         _gib(23.69), _peaks(71e12, 35.6e12, 35.6e12), 936e9, (8, 6), ("rtx 3090",)),
    Card("NVIDIA RTX A6000", ("a6000", "rtx-a6000", "rtxa6000"),
         _gib(47.53), _peaks(154.8e12, 38.7e12, 77.4e12), 768e9, (8, 6), ("rtx a6000",)),
    Card("NVIDIA Tesla V100 32GB (SXM2)", ("v100-32gb", "v100-sxm2-32gb"),
         _gib(31.75), _peaks(None, 15.7e12, None, fp16=125e12), 900e9, (7, 0),
         ("v100-sxm2-32gb", "v100-pcie-32gb", "v100s")),
    Card("NVIDIA Tesla V100 16GB (SXM2)", ("v100", "v100-16gb", "v100-sxm2-16gb"),
         _gib(15.77), _peaks(None, 15.7e12, None, fp16=125e12), 900e9, (7, 0), ("v100",)),
    Card("NVIDIA Tesla T4", ("t4", "tesla-t4"),
         _gib(14.75), _peaks(None, 8.1e12, None, fp16=65e12), 320e9, (7, 5), ("t4",)),
)

# Every alias and display name names one card (tests/test_cards.py checks that none is shared).
_BY_NAME = {key: card for card in CARDS for key in (*card.aliases, card.name.lower())}

# (fragment, card) pairs to match CUDA's device names, longest fragment first: a longer fragment is
# the more specific name ("h100 pcie" before "h100", "gh200" before "h200", "a100" before "a10").
DEVICE_FRAGMENTS: tuple[tuple[str, Card], ...] = tuple(sorted(
    ((fragment, card) for card in CARDS for fragment in card.name_fragments), key=lambda pair: -len(pair[0])))


def _normalise(name: str) -> str:
    """'NVIDIA H100 SXM' -> 'h100-sxm': lower case, no vendor prefix, spaces and '_' as '-'."""
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    return re.sub(r"^nvidia-", "", text)


def card_names() -> list[str]:
    """Each card's short name (its first alias), sorted."""
    return sorted(card.short_name for card in CARDS)


def find_card(name: str) -> Card:
    """The card `--gpu NAME` means: by alias or display name, in any case; BadInput when unknown."""
    card = _BY_NAME.get(name.strip().lower()) or _BY_NAME.get(_normalise(name))
    if card is None:
        raise BadInput(f"--gpu {name!r} is unknown; choose from {', '.join(card_names())}.")
    return card


def card_for_device(device_name: str) -> Card | None:
    """The card whose CUDA device name this is ('NVIDIA H100 PCIe', 'Tesla T4'), or None."""
    name = device_name.lower()
    for fragment, card in DEVICE_FRAGMENTS:
        if fragment in name:
            return card
    return None
