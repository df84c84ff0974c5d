"""The GPUs the planner knows, from their spec sheets: dense bf16 peak (for MFU), memory and bandwidth, keyed by the
exact name torch.cuda.get_device_name and nvidia-smi report; FLOPs per token of a model."""
from __future__ import annotations

# dense bf16 peak of one GPU (NVIDIA's spec sheets: half the figure "with sparsity"), for MFU, keyed by the
# exact name torch.cuda.get_device_name and nvidia-smi report: the three H100s differ by a third, so a
# GPU not listed gets mfu = null rather than a neighbour's peak
GPU_PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,            # H100 SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,                      # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L40S": 362e12,
}
# the memory of each card (spec sheet, GB as GiB: PyTorch shows a little less, 79.2 of an H100's 80), planned
# against where the card is named but not visible (the launcher's dry run, nvidia-smi on another node)
GPU_MEMORY_GIB = {
    "NVIDIA H100 80GB HBM3": 80, "NVIDIA H100 PCIe": 80, "NVIDIA H100 NVL": 94, "NVIDIA H200": 141,
    "NVIDIA H200 NVL": 141, "NVIDIA GH200 480GB": 96, "NVIDIA A100-SXM4-40GB": 40, "NVIDIA A100-SXM4-80GB": 80,
    "NVIDIA A100-PCIE-40GB": 40, "NVIDIA A100 80GB PCIe": 80, "NVIDIA B200": 180, "NVIDIA L40S": 48,
}
# the documented node's GPU (docs/planning.md: 8 x H100 SXM), what a plan assumes where no GPU can be asked
ASSUMED_GPU = "NVIDIA H100 80GB HBM3"


def flops_per_token(cfg: Config, params: dict) -> float:
    """6N for the weight matmuls (forward + backward) + 12 * depth * width * seq_len for attention (PaLM), where N is
    the body's parameters and the head's: the head is the token embedding used again (tied), a (vocabulary x width)
    matmul every token, 6% of a depth-32 step; the embeddings' lookups cost no FLOPs. count_parameters' `params`."""
    head = params["embedding"] - cfg.seq_len * cfg.width           # the token embedding, without the positions'
    return 6 * (params["non_embedding"] + head) + 12 * cfg.depth * cfg.width * cfg.seq_len


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the device named `name` (device_name), None where it is not known."""
    return GPU_PEAK_BF16_FLOPS.get(name)


# the memory bandwidth of each card (spec sheet, bytes/s), for the kernels that only move data
GPU_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12, "NVIDIA H100 NVL": 3.9e12, "NVIDIA H200": 4.8e12,
    "NVIDIA H200 NVL": 4.8e12, "NVIDIA GH200 480GB": 4.0e12, "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12, "NVIDIA A100-PCIE-40GB": 1.555e12, "NVIDIA A100 80GB PCIe": 1.935e12,
    "NVIDIA B200": 8.0e12, "NVIDIA L40S": 0.864e12,
}
