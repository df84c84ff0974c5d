"""hcstudy/planner/gpus.py: the cards' spec sheets, read by their exact device names."""
import pytest

from hcstudy.planner import gpus


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
                                        ("NVIDIA H100 80GB HBM3e", None), ("NVIDIA GeForce RTX 4090", None),
                                        ("cpu", None)])
def test_gpu_peak_is_the_exact_device_names_and_unknown_devices_get_none(name, peak):
    """A PCIe H100 is not credited with the SXM's peak; a name not listed gets no MFU rather than a wrong one."""
    assert gpus.gpu_peak_flops(name) == peak
