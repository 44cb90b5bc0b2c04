import pytest

from autotune.probe.devices import peak_flops


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA GeForce RTX 4090", "fp32", 82.6e12),
    ],
)
def test_peak_flops_of_known_cards(name, precision, expected):
    assert peak_flops(name, precision) == expected


def test_unknown_card_or_precision_has_no_peak_so_no_mfu():
    assert peak_flops("Some Future GPU", "bf16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
