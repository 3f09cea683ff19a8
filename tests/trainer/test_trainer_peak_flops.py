import pytest

from trainer.metrics import H100_PCIE_PEAK_BF16, peak_flops_for_name


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", H100_PCIE_PEAK_BF16),
    ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA H200", 989e12),
    ("Tesla T4", 65e12),
    ("Some Unknown Accelerator", None),
])
def test_peak_flops_by_device_name(name, peak):
    assert peak_flops_for_name(name) == peak
