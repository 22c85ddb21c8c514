"""Device and link presets for the machines people plan for (``mpar plan --cluster``).

Each preset is one accelerator and how its ranks are connected: the dense bf16 peak,
the memory per device, the bandwidth between devices of a node (NVLink, or ICI on a
TPU host) and between nodes (InfiniBand, one NIC per GPU), and the devices per node.
The figures are the vendors' published ones (docs/planning.md, "Cluster presets",
lists the sources); bandwidths are per device and per direction.

The planner times a unit from its FLOPs: ``flops / (bf16 peak x efficiency)`` under
bf16 (and ``mixed_speedup`` times that in fp32). ``efficiency`` is the model FLOPs
utilisation a tuned dense-transformer run reaches on that device (``MFU_ASSUMED``):
an assumption, not a measurement, until calibrated on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpar.profile import ModelProfile

__all__ = [
    "CLUSTERS",
    "MFU_ASSUMED",
    "Cluster",
    "cluster",
    "default_cluster",
    "timed_by_flops",
]

GB = 1e9
TFLOPS = 1e12

MFU_ASSUMED = 0.4
"""Assumed model FLOPs utilisation of the bf16 peak, between torchtitan's published
figures (Llama 3 70B, FSDP2 on 64 A100s: 0.517; Llama 3.1 8B, FSDP on H100s:
0.33-0.39; docs/planning.md cites them); not calibrated on a GPU."""


@dataclass(frozen=True)
class Cluster:
    """One kind of accelerator and its links."""

    name: str
    device: str
    """The device kind mpar runs it as: "cuda" or "xla"."""
    bf16_flops: float
    """Dense bf16 peak, FLOP/s per device."""
    memory_bytes: int
    intra_node_bandwidth: float
    """Bytes/s per device, one direction, to the devices of its node (NVLink, ICI)."""
    inter_node_bandwidth: float
    """Bytes/s per device, one direction, to other nodes (InfiniBand NIC; ICI on TPU)."""
    devices_per_node: int
    host_bandwidth: float = 50 * GB
    """Bytes/s between a device and its host's memory (PCIe Gen5 x16 about 64 GB/s)."""
    efficiency: float = MFU_ASSUMED

    @property
    def flops_per_second(self) -> float:
        """The bf16 speed the planner assumes: peak times efficiency."""
        return self.bf16_flops * self.efficiency

    def describe(self) -> str:
        return (
            f"cluster {self.name}: {self.bf16_flops / TFLOPS:.0f} TFLOP/s bf16 peak x "
            f"{self.efficiency:.0%} assumed MFU, {self.memory_bytes / 2**30:.0f} GiB per "
            f"device, {self.devices_per_node} per node, {self.intra_node_bandwidth / GB:.0f} "
            f"GB/s in a node (tp), {self.inter_node_bandwidth / GB:.0f} GB/s between nodes "
            "(dp, pipeline)"
        )


CLUSTERS: dict[str, Cluster] = {
    # H100 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3, NVLink 4 900 GB/s both ways,
    # one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100)
    "h100": Cluster("h100", "cuda", 989 * TFLOPS, 80 * 2**30, 450 * GB, 50 * GB, 8),
    # H200 SXM: the H100's compute and links, 141 GB HBM3e
    "h200": Cluster("h200", "cuda", 989 * TFLOPS, 141 * 10**9, 450 * GB, 50 * GB, 8),
    # A100 SXM4 80GB: 312 TFLOP/s dense bf16, NVLink 3 600 GB/s both ways, 200 Gb/s
    # HDR InfiniBand per GPU (DGX A100), PCIe Gen4 host link
    "a100": Cluster("a100", "cuda", 312 * TFLOPS, 80 * 2**30, 300 * GB, 25 * GB, 8, 25 * GB),
    # TPU v5p: 459 TFLOP/s bf16, 95 GB HBM2e, ICI 4,800 Gb/s per chip (600 GB/s) across
    # the slice (the 4 chips of a host are a node here)
    "tpu-v5p": Cluster("tpu-v5p", "xla", 459 * TFLOPS, 95 * 10**9, 300 * GB, 300 * GB, 4),
}


def cluster(name: str) -> Cluster:
    """The preset called ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return CLUSTERS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)} (or give --device, "
            "--device-memory and the bandwidths yourself)"
        ) from None


def default_cluster(device: str) -> Cluster | None:
    """The preset assumed for a device kind named without ``--cluster``: H100 for
    "cuda", TPU v5p for "xla"; None for the CPU (measured where it runs)."""
    return {"cuda": CLUSTERS["h100"], "xla": CLUSTERS["tpu-v5p"]}.get(device)


def timed_by_flops(profile: ModelProfile, cluster: Cluster, mixed_speedup: float) -> ModelProfile:
    """``profile`` with each unit's time its FLOPs at the cluster's assumed speed: the
    profile is fp32, so ``bf16 peak x efficiency / mixed_speedup`` (the planner divides
    by ``mixed_speedup`` again under bf16). Measured times, and their fixed part, are
    replaced: they were the machine that profiled, not the cluster's."""
    speed = cluster.flops_per_second / mixed_speedup
    units = [replace(u, time_s=u.flops / speed, fixed_time_s=0.0) for u in profile.units]
    return replace(profile, units=units)
