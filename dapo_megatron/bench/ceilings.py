"""What this machine can reach, measured in the same run as the phases it judges.

A tokens-per-second figure means little on its own: a 2-core CI box and an H200 differ by
five orders of magnitude. Each phase of ``dapo-megatron bench`` is therefore reported as a
fraction of a *ceiling* measured here, side by side:

- **matmul**: plain ``torch.mm`` at the model's own GEMM shapes (one tensor-parallel
  rank's q/k/v, output projection, gate/up, down and output layer, at the micro-batch's
  token count), in the actor's dtype, on each rank at once (so the ranks contend for the
  machine as they do when training). Its FLOP/s are what the train and log-prob phases
  could reach if they did nothing but their matmuls.
- **copy**: a plain ``copy_`` of as many bytes as the weight sync moves, on the device
  the engines serve from: the bandwidth a sync could reach if it were one copy.

On a GPU the figures are also compared with the device's published dense peak
(:data:`PUBLISHED_PEAKS`, overridable), which is what MFU conventionally means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DevicePeak:
    """A device's published dense peak: bf16 tensor-core FLOP/s and memory bandwidth."""

    bf16_tflops: float
    """Dense bf16 TFLOP/s (no sparsity)."""
    memory_tb_per_s: float
    """HBM bandwidth, TB/s."""


PUBLISHED_PEAKS: dict[str, DevicePeak] = {
    # Vendors' data sheets, dense (not 2:4 sparse) figures. Keys match a substring of
    # torch.cuda.get_device_name(); the first match wins, so the longer names come first.
    "H100 PCIe": DevicePeak(756.0, 2.0),
    "H100": DevicePeak(989.4, 3.35),
    "H200": DevicePeak(989.4, 4.8),
    "H20": DevicePeak(148.0, 4.0),
    "B200": DevicePeak(2250.0, 8.0),
    "A100": DevicePeak(312.0, 2.0),
    "L40S": DevicePeak(362.0, 0.864),
}


def published_peak(device_name: str) -> Optional[DevicePeak]:
    """The table's entry for ``device_name`` (a ``torch.cuda.get_device_name()``), if any."""
    for key, peak in PUBLISHED_PEAKS.items():
        if key in device_name:
            return peak
    return None
