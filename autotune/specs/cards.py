"""Common NVIDIA cards as data: memory, peak FLOP/s, bandwidth and features, for `autotune plan
--gpu NAME` (a card the user does not have) and for MFU on the card a probe runs on
(`autotune.probe.devices.peak_flops`, matched on CUDA's device name).

Torch-free: the planner and the CLI read this table before any probe starts.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from autotune.vocabulary.errors import BadInput

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

    name: str  # display name
    aliases: tuple[str, ...]  # lower-case names `--gpu` accepts; the first is the card's short name
    memory_bytes: int  # total memory CUDA reports (bytes)
    peak_flops: dict[str, float] = field(hash=False)  # dense FLOP/s by precision: fp32, tf32, bf16, fp16
    memory_bandwidth: float  # bytes/s, from the data sheet
    compute_capability: tuple[int, int]
    name_fragments: tuple[str, ...]  # lower-case pieces of CUDA's device name(s) for this card
    # The CUDA context (with its loaded kernels, outside PyTorch's allocator) where this card's own was
    # measured; None: the estimator's (autotune/estimate/cuda_constants.json, measured on an H100),
    # whose one home that figure is.
    context_bytes: int | None = None
    # Bytes/s one GPU sends to its peers in one direction (NVLink on SXM boards, else PCIe through
    # the host), and to the host (PCIe): half the data sheet's bidirectional figure (see _LINKS).
    interconnect_bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    # A CPU "card": the host launches each op and then runs it itself, so the launching adds to the
    # work instead of hiding behind a card's (the speed model's dispatch).
    host_is_device: bool = False
    # Share of the dense bf16/fp16 peak the card's best matmul reaches, as measured (see
    # _MATMUL_CEILINGS); `matmul_ceiling` answers DEFAULT_MATMUL_CEILING for a card nobody measured.
    measured_matmul_ceiling: float | None = None

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
    def matmul_ceiling(self) -> float:
        """Share of the dense tensor-core peak the card's best matmul reaches (its "maximum achievable
        matmul FLOPS" over the data sheet's): measured where published, else DEFAULT_MATMUL_CEILING."""
        return self.measured_matmul_ceiling or DEFAULT_MATMUL_CEILING

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
    Card(
        "NVIDIA H100 80GB HBM3 (SXM)",
        ("h100", "h100-sxm", "h100-sxm5", "h100-80gb", "h100-hbm3"),
        85_029_158_912,
        _peaks(989e12, 67e12, 495e12),
        3.35e12,
        (9, 0),
        ("h100",),
    ),
    Card(
        "NVIDIA H100 PCIe",
        ("h100-pcie", "h100-pcie-80gb"),
        85_029_158_912,
        _peaks(756e12, 51e12, 378e12),
        2.0e12,
        (9, 0),
        ("h100 pcie",),
    ),
    Card(
        "NVIDIA H100 NVL",
        ("h100-nvl", "h100-94gb"),
        _gib(93.00),
        _peaks(835e12, 60e12, 417e12),
        3.9e12,
        (9, 0),
        ("h100 nvl",),
    ),
    Card(
        "NVIDIA H200 (SXM)",
        ("h200", "h200-sxm", "h200-141gb"),
        _gib(139.80),
        _peaks(989e12, 67e12, 495e12),
        4.8e12,
        (9, 0),
        ("h200",),
    ),
    Card(
        "NVIDIA GH200 (96GB HBM3)",
        ("gh200", "gh200-96gb", "grace-hopper"),
        _gib(94.50),
        _peaks(989e12, 67e12, 495e12),
        4.0e12,
        (9, 0),
        ("gh200",),
    ),
    Card(
        "NVIDIA B200",
        ("b200", "b200-sxm", "b200-180gb"),
        _gib(178.35),
        _peaks(2250e12, 75e12, 1100e12),
        8.0e12,
        (10, 0),
        ("b200",),
    ),
    Card(
        "NVIDIA A100 80GB",
        ("a100", "a100-80gb", "a100-sxm", "a100-sxm4-80gb", "a100-pcie-80gb"),
        _gib(79.15),
        _peaks(312e12, 19.5e12, 156e12),
        2.039e12,
        (8, 0),
        ("a100-sxm4-80gb", "a100 80gb"),
    ),
    Card(
        "NVIDIA A100 40GB",
        ("a100-40gb", "a100-sxm4-40gb", "a100-pcie-40gb"),
        _gib(39.50),
        _peaks(312e12, 19.5e12, 156e12),
        1.555e12,
        (8, 0),
        ("a100",),
    ),
    Card("NVIDIA A10G", ("a10g",), _gib(21.99), _peaks(125e12, 31.2e12, 62.5e12), 600e9, (8, 6), ("a10g",)),
    Card("NVIDIA A10", ("a10",), _gib(21.99), _peaks(125e12, 31.2e12, 62.5e12), 600e9, (8, 6), ("a10",)),
    Card("NVIDIA L40S", ("l40s",), _gib(44.40), _peaks(362e12, 91.6e12, 183e12), 864e9, (8, 9), ("l40s",)),
    Card("NVIDIA L4", ("l4",), _gib(22.05), _peaks(121e12, 30.3e12, 60e12), 300e9, (8, 9), ("l4",)),
    Card(
        "NVIDIA GeForce RTX 4090",
        ("rtx4090", "rtx-4090", "4090", "geforce-rtx-4090"),
        25_386_352_640,
        _peaks(165e12, 82.6e12, 82.6e12),
        1008e9,
        (8, 9),
        ("rtx 4090",),
    ),
    Card(
        "NVIDIA GeForce RTX 3090",
        ("rtx3090", "rtx-3090", "3090", "geforce-rtx-3090"),
        _gib(23.69),
        _peaks(71e12, 35.6e12, 35.6e12),
        936e9,
        (8, 6),
        ("rtx 3090",),
    ),
    Card(
        "NVIDIA RTX A6000",
        ("a6000", "rtx-a6000", "rtxa6000"),
        _gib(47.53),
        _peaks(154.8e12, 38.7e12, 77.4e12),
        768e9,
        (8, 6),
        ("rtx a6000",),
    ),
    Card(
        "NVIDIA Tesla V100 32GB (SXM2)",
        ("v100-32gb", "v100-sxm2-32gb"),
        _gib(31.75),
        _peaks(None, 15.7e12, None, fp16=125e12),
        900e9,
        (7, 0),
        ("v100-sxm2-32gb", "v100-pcie-32gb", "v100s"),
    ),
    Card(
        "NVIDIA Tesla V100 16GB (SXM2)",
        ("v100", "v100-16gb", "v100-sxm2-16gb"),
        _gib(15.77),
        _peaks(None, 15.7e12, None, fp16=125e12),
        900e9,
        (7, 0),
        ("v100",),
    ),
    Card(
        "NVIDIA Tesla T4",
        ("t4", "tesla-t4"),
        _gib(14.75),
        _peaks(None, 8.1e12, None, fp16=65e12),
        320e9,
        (7, 5),
        ("t4",),
    ),
    # Consumer and workstation cards of 6-16 GB. Peaks and bandwidth from NVIDIA's data sheets and
    # architecture whitepapers (Turing TU102/TU104, Ampere GA102/GA104/GA106 and Ada AD102-AD107: the
    # "Peak FP16 Tensor TFLOPS with FP32 Accumulate" row, dense, at the reference boost clock), as
    # recalled (the sheets were not at hand when this was written): where a card is not in a table, its peak is
    # the same rule worked out from its SM count and boost clock (GeForce Ampere and Ada per SM and
    # clock: 256 FP32 FLOPs, 256 TF32 tensor FLOPs, 512 FP16/BF16 tensor FLOPs with FP32
    # accumulation, half the FP16-accumulate rate; RTX A-series workstation cards run the full rate,
    # 1024, and TF32 at 512; Turing GeForce: 128 FP32, 512 FP16 tensor with FP32 accumulation).
    # Bandwidth is the memory's data rate times its bus width. Memory totals are what PyTorch's
    # out-of-memory message reported for the card on Linux in public bug reports (RTX 3060 12GB
    # 11.75 GiB, RTX 3070 7.78, RTX 3080 9.78, RTX 2080 Ti 10.76, RTX 4060 7.72, RTX 4070 Ti 11.73,
    # RTX A4000 15.61); the others (marked "est.") are a card of the same memory and generation's
    # figure: within about 0.1 GiB, as the driver also moves it. Windows (WDDM) reports other totals.
    # memory est.; also matches a 4080 SUPER (7% faster)
    Card(
        "NVIDIA GeForce RTX 4080",
        ("rtx4080", "rtx-4080", "4080", "geforce-rtx-4080"),
        _gib(15.70),
        _peaks(97.5e12, 48.7e12, 48.7e12),
        716.8e9,
        (8, 9),
        ("rtx 4080",),
    ),
    # 66 SMs, 2610 MHz; memory est.
    Card(
        "NVIDIA GeForce RTX 4070 Ti SUPER",
        ("rtx4070tisuper", "rtx-4070-ti-super", "4070-ti-super", "geforce-rtx-4070-ti-super"),
        _gib(15.70),
        _peaks(88.2e12, 44.1e12, 44.1e12),
        672e9,
        (8, 9),
        ("rtx 4070 ti super",),
    ),
    # 60 SMs, 2610 MHz
    Card(
        "NVIDIA GeForce RTX 4070 Ti",
        ("rtx4070ti", "rtx-4070-ti", "4070-ti", "geforce-rtx-4070-ti"),
        _gib(11.73),
        _peaks(80.2e12, 40.1e12, 40.1e12),
        504e9,
        (8, 9),
        ("rtx 4070 ti",),
    ),
    # 46 SMs, 2475 MHz; memory est.
    Card(
        "NVIDIA GeForce RTX 4070",
        ("rtx4070", "rtx-4070", "4070", "geforce-rtx-4070"),
        _gib(11.73),
        _peaks(58.3e12, 29.1e12, 29.1e12),
        504e9,
        (8, 9),
        ("rtx 4070",),
    ),
    # 34 SMs, 2535 MHz; memory est.; CUDA names it as the 8GB
    Card(
        "NVIDIA GeForce RTX 4060 Ti 16GB",
        ("rtx4060ti-16gb", "rtx-4060-ti-16gb", "4060-ti-16gb"),
        _gib(15.70),
        _peaks(44.1e12, 22.1e12, 22.1e12),
        288e9,
        (8, 9),
        (),
    ),
    # memory est.
    Card(
        "NVIDIA GeForce RTX 4060 Ti 8GB",
        ("rtx4060ti", "rtx-4060-ti", "4060-ti", "rtx4060ti-8gb", "geforce-rtx-4060-ti"),
        _gib(7.72),
        _peaks(44.1e12, 22.1e12, 22.1e12),
        288e9,
        (8, 9),
        ("rtx 4060 ti",),
    ),
    # 24 SMs, 2460 MHz
    Card(
        "NVIDIA GeForce RTX 4060",
        ("rtx4060", "rtx-4060", "4060", "geforce-rtx-4060"),
        _gib(7.72),
        _peaks(30.2e12, 15.1e12, 15.1e12),
        272e9,
        (8, 9),
        ("rtx 4060",),
    ),
    # 80 SMs, 1665 MHz; memory est.
    Card(
        "NVIDIA GeForce RTX 3080 Ti",
        ("rtx3080ti", "rtx-3080-ti", "3080-ti", "geforce-rtx-3080-ti"),
        _gib(11.75),
        _peaks(68.2e12, 34.1e12, 34.1e12),
        912e9,
        (8, 6),
        ("rtx 3080 ti",),
    ),
    # 70 SMs, 1710 MHz; memory est.; CUDA names it as the 10GB
    Card(
        "NVIDIA GeForce RTX 3080 12GB",
        ("rtx3080-12gb", "rtx-3080-12gb", "3080-12gb"),
        _gib(11.75),
        _peaks(61.3e12, 30.6e12, 30.6e12),
        912e9,
        (8, 6),
        (),
    ),
    Card(
        "NVIDIA GeForce RTX 3080 10GB",
        ("rtx3080", "rtx-3080", "3080", "rtx3080-10gb", "geforce-rtx-3080"),
        _gib(9.78),
        _peaks(59.5e12, 29.8e12, 29.8e12),
        760e9,
        (8, 6),
        ("rtx 3080",),
    ),
    # 48 SMs, 1770 MHz; memory est.
    Card(
        "NVIDIA GeForce RTX 3070 Ti",
        ("rtx3070ti", "rtx-3070-ti", "3070-ti", "geforce-rtx-3070-ti"),
        _gib(7.78),
        _peaks(43.5e12, 21.7e12, 21.7e12),
        608e9,
        (8, 6),
        ("rtx 3070 ti",),
    ),
    Card(
        "NVIDIA GeForce RTX 3070",
        ("rtx3070", "rtx-3070", "3070", "geforce-rtx-3070"),
        _gib(7.78),
        _peaks(40.6e12, 20.3e12, 20.3e12),
        448e9,
        (8, 6),
        ("rtx 3070",),
    ),
    # 38 SMs, 1665 MHz; memory est.
    Card(
        "NVIDIA GeForce RTX 3060 Ti",
        ("rtx3060ti", "rtx-3060-ti", "3060-ti", "geforce-rtx-3060-ti"),
        _gib(7.78),
        _peaks(32.4e12, 16.2e12, 16.2e12),
        448e9,
        (8, 6),
        ("rtx 3060 ti",),
    ),
    # 28 SMs, 1777 MHz
    Card(
        "NVIDIA GeForce RTX 3060 12GB",
        ("rtx3060", "rtx-3060", "3060", "rtx3060-12gb", "geforce-rtx-3060"),
        _gib(11.75),
        _peaks(25.5e12, 12.7e12, 12.7e12),
        360e9,
        (8, 6),
        ("rtx 3060",),
    ),
    Card(
        "NVIDIA GeForce RTX 2080 Ti",
        ("rtx2080ti", "rtx-2080-ti", "2080-ti", "geforce-rtx-2080-ti"),
        _gib(10.76),
        _peaks(None, 13.4e12, None, fp16=53.8e12),
        616e9,
        (7, 5),
        ("rtx 2080 ti",),
    ),
    # memory est.; also matches a 2080 SUPER
    Card(
        "NVIDIA GeForce RTX 2080",
        ("rtx2080", "rtx-2080", "2080", "geforce-rtx-2080"),
        _gib(7.78),
        _peaks(None, 10.1e12, None, fp16=40.3e12),
        448e9,
        (7, 5),
        ("rtx 2080",),
    ),
    # data sheet: 19.2 FP32, 153.4 sparse tensor
    Card(
        "NVIDIA RTX A4000",
        ("a4000", "rtx-a4000", "rtxa4000"),
        _gib(15.61),
        _peaks(76.7e12, 19.2e12, 38.4e12),
        448e9,
        (8, 6),
        ("rtx a4000",),
    ),
    # data sheet: 8.0 FP32, 63.9 sparse tensor; memory est.
    Card(
        "NVIDIA RTX A2000 12GB",
        ("a2000-12gb", "rtx-a2000-12gb", "rtxa2000-12gb"),
        _gib(11.75),
        _peaks(32.0e12, 8.0e12, 16.0e12),
        288e9,
        (8, 6),
        ("rtx a2000 12gb",),
    ),
    # the 6GB; memory est.
    Card(
        "NVIDIA RTX A2000",
        ("a2000", "rtx-a2000", "rtxa2000", "a2000-6gb"),
        _gib(5.79),
        _peaks(32.0e12, 8.0e12, 16.0e12),
        288e9,
        (8, 6),
        ("rtx a2000",),
    ),
)

# Links by card, from NVIDIA's data sheets (bidirectional totals, GB/s): NVLink 4 on H100/H200 SXM
# and GH200 900, PCIe Gen5 128 (H100 SXM/PCIe/NVL, H200 data sheets); H100 NVL's NVLink bridge 600;
# B200 NVLink 5 1800 (HGX B200 data sheet), PCIe Gen5 128; A100 SXM NVLink 3 600, PCIe Gen4 64
# (A100 data sheet; the "a100" entry is the SXM board); V100 SXM2 NVLink 2 300, PCIe Gen3 32 (V100
# data sheet). Cards without NVLink talk through PCIe: Gen4 x16 64 (A10, A10G, L4, L40S, RTX 30/40
# series and RTX A-series data sheets), Gen4 x8 32 (RTX 4060, 4060 Ti), Gen3 x16 32 (T4, RTX 20
# series). (NVLink bridges of PCIe cards, optional, are not assumed.)
_NVLINK_GBS = {
    "h100": 900,
    "h200": 900,
    "gh200": 900,
    "h100-nvl": 600,
    "b200": 1800,
    "a100": 600,
    "a100-40gb": 600,
    "v100-32gb": 300,
    "v100": 300,
}
_PCIE_GBS = {
    "h100": 128,
    "h100-pcie": 128,
    "h100-nvl": 128,
    "h200": 128,
    "gh200": 128,
    "b200": 128,
    "v100-32gb": 32,
    "v100": 32,
    "t4": 32,
    "rtx2080ti": 32,
    "rtx2080": 32,
    "rtx4060ti": 32,
    "rtx4060ti-16gb": 32,
    "rtx4060": 32,
}
PCIE_GEN4_GBS = 64


# What a card's best bf16 matmul reaches, as a share of its data sheet's dense peak: the data sheet's
# figure is at the boost clock, which data-center cards do not hold under a GEMM's power draw and
# GeForce cards exceed. A100 80GB SXM 271.2 of 312 TFLOPS, H100 SXM 794.5 of 989 ("H200 is the same"),
# GH200 828.6 of 989, B200 1745.0 of 2250: Stas Bekman's "Maximum Achievable Matmul FLOPS comparison
# table" (ml-engineering, compute/accelerator/README.md; mamf-finder.py, the mean of 100 iterations
# at the best shape of a search, torch 2.6-2.7). A100 40GB 246.33 of 312, RTX 3090 76.34 and 76.68
# of 71, RTX 4090 (24 GB) 170.06, 173.31, 162.39 and 163.09 of 165 (their median): the bf16 column
# of zzc0721/torch-performance-test-data's database.md (square matmuls of 1-10k, the best size;
# contributors' machines and cloud containers, torch 2.2-2.8): fewer shapes searched and less
# controlled than Bekman's, and within 1% of his where both measured a card (H100 789.24, A100 SXM4
# 80GB 264.53). A card in neither table takes the median of the data-center cards measured (0.803).
_MATMUL_CEILINGS = {
    "a100": 271.2 / 312,
    "h100": 794.5 / 989,
    "h200": 794.5 / 989,
    "gh200": 828.6 / 989,
    "b200": 1745.0 / 2250,
    "a100-40gb": 246.33 / 312,
    "rtx3090": (76.34 + 76.68) / 2 / 71,
    "rtx4090": (163.09 + 170.06) / 2 / 165,
}
DEFAULT_MATMUL_CEILING = statistics.median(
    _MATMUL_CEILINGS[name] for name in ("a100", "a100-40gb", "h100", "gh200", "b200")
)


def _linked(card: Card) -> Card:
    from dataclasses import replace

    pcie = _PCIE_GBS.get(card.short_name, PCIE_GEN4_GBS) * 1e9 / 2
    nvlink = _NVLINK_GBS.get(card.short_name)
    return replace(
        card,
        interconnect_bandwidth=nvlink * 1e9 / 2 if nvlink else pcie,
        host_bandwidth=pcie,
        measured_matmul_ceiling=_MATMUL_CEILINGS.get(card.short_name),
    )


CARDS = tuple(_linked(card) for card in CARDS)

# Every alias and display name names one card (tests/test_cards.py checks that none is shared).
_BY_NAME = {key: card for card in CARDS for key in (*card.aliases, card.name.lower())}

# (fragment, card) pairs to match CUDA's device names, longest fragment first: a longer fragment is
# the more specific name ("h100 pcie" before "h100", "gh200" before "h200", "a100" before "a10").
DEVICE_FRAGMENTS: tuple[tuple[str, Card], ...] = tuple(
    sorted(((fragment, card) for card in CARDS for fragment in card.name_fragments), key=lambda pair: -len(pair[0]))
)


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


def find_cards(names: list[str]) -> list[Card]:
    """The cards `--gpu A,B,...` names, each once, in the order given; an unknown name is refused
    with the names this table knows, nearest first."""
    import difflib

    cards: list[Card] = []
    for name in names:
        card = _BY_NAME.get(name.strip().lower()) or _BY_NAME.get(_normalise(name))
        if card is None:
            known = card_names()
            near = difflib.get_close_matches(name.strip().lower(), list(_BY_NAME), n=len(_BY_NAME), cutoff=0.0)
            ordered = list(dict.fromkeys([_BY_NAME[alias].short_name for alias in near] + known))
            raise BadInput(f"--gpu {name!r} is unknown; the cards it knows, nearest first: {', '.join(ordered)}.")
        if card not in cards:
            cards.append(card)
    if not cards:
        raise BadInput("--gpu: the list is empty; give cards like h100,a100-80gb,l4, or all.")
    return cards


def card_for_device(device_name: str) -> Card | None:
    """The card whose CUDA device name this is ('NVIDIA H100 PCIe', 'Tesla T4'), or None."""
    name = device_name.lower()
    for fragment, card in DEVICE_FRAGMENTS:
        if fragment in name:
            return card
    return None
