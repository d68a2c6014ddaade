"""Device figures from vendor data sheets, per accelerator model. Pure.

What `topology.from_cluster` takes as the defaults of `device:` and of the device-side
link classes when the cluster names its accelerator (`gpu.accelerator_type`, `tpu.type`),
before any `meshpipe calibrate`. They are PEAK figures (dense, no sparsity), so a
plan costed on them is optimistic about compute; calibrate replaces them by measured ones.

GPU (SXM boards; `gpu.accelerator_type` as Ray names it):
  memory_gb     HBM × XLA's memory fraction: XLA preallocates / may use 75 % of each
                GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION), `gpu.memory_fraction`
                when set: H100 80 GB × 0.75 = 60 GB, H200 141 GB × 0.75 = 105.75 GB.
  tflops        dense TF32 tensor-core peak (JAX runs float32 matmuls in TF32 on these
                GPUs by default), per GPU; `bf16_tflops` is recorded beside it.
  nvlink_gbps   NVLink per GPU, one direction (900 GB/s both ways on H100/H200).
  pcie_gbps     PCIe per GPU, one direction (Gen5 ×16: 64 GB/s; Gen4: 32 GB/s): the
                ceiling of a device↔host copy; pageable copies reach well under it.
TPU (per chip; `tpu.type`'s version; a v2/v3 chip is two JAX devices, which split it):
  memory_gb     HBM (XLA on TPU keeps no fraction back).
  tflops        bf16 peak.
  ici_gbps      one ICI link, one direction: the chip's ICI bandwidth (all links, both
                directions, as published) / (2 × links): v5e 1,600 Gbps over 4 links.
Unknown models: the platform's generic defaults (`topology.DEFAULTS`), said in the plan's notes.
"""
from __future__ import annotations

from typing import Mapping, Optional

__all__ = ["GPUS", "TPUS", "XLA_GPU_MEMORY_FRACTION", "gpu_figures", "tpu_figures"]

XLA_GPU_MEMORY_FRACTION = 0.75     # XLA_PYTHON_CLIENT_MEM_FRACTION's default

# name -> HBM GB, TF32 dense TFLOP/s, bf16 dense TFLOP/s, HBM GB/s, NVLink GB/s per direction, PCIe GB/s per direction
GPUS: Mapping[str, Mapping[str, float]] = {
    "H100": {"hbm_gb": 80, "tflops": 494.7, "bf16_tflops": 989.4, "memory_bandwidth_gbps": 3350,
             "nvlink_gbps": 450, "pcie_gbps": 64},
    "H200": {"hbm_gb": 141, "tflops": 494.7, "bf16_tflops": 989.4, "memory_bandwidth_gbps": 4800,
             "nvlink_gbps": 450, "pcie_gbps": 64},
    "A100-80G": {"hbm_gb": 80, "tflops": 156, "bf16_tflops": 312, "memory_bandwidth_gbps": 2039,
                 "nvlink_gbps": 300, "pcie_gbps": 32},
    "A100-40G": {"hbm_gb": 40, "tflops": 156, "bf16_tflops": 312, "memory_bandwidth_gbps": 1555,
                 "nvlink_gbps": 300, "pcie_gbps": 32},
}
_GPU_ALIASES = {"A100": "A100-40G", "H100-80G": "H100", "H100-SXM": "H100", "H200-141G": "H200"}

# version -> HBM GB, bf16 TFLOP/s, HBM GB/s per chip; ICI Gbps per chip (all links, both ways) and its links
TPUS: Mapping[str, Mapping[str, float]] = {
    "v4": {"hbm_gb": 32, "tflops": 275, "memory_bandwidth_gbps": 1228, "ici_chip_gbit": 2400, "ici_links": 6},
    "v5litepod": {"hbm_gb": 16, "tflops": 197, "memory_bandwidth_gbps": 819, "ici_chip_gbit": 1600, "ici_links": 4},
    "v5p": {"hbm_gb": 95, "tflops": 459, "memory_bandwidth_gbps": 2765, "ici_chip_gbit": 4800, "ici_links": 6},
    "v6e": {"hbm_gb": 32, "tflops": 918, "memory_bandwidth_gbps": 1640, "ici_chip_gbit": 3584, "ici_links": 4},
}


def gpu_figures(accelerator_type: Optional[str], memory_fraction: Optional[float] = None) -> Optional[dict]:
    """Per-GPU defaults for a Ray accelerator type, or None when the model is not in `GPUS`.

    Example:
        >>> f = gpu_figures("H100")
        >>> f["memory_gb"], f["tflops"], f["nvlink_gbps"]
        (60.0, 494.7, 450)
        >>> gpu_figures("H200", 0.9)["memory_gb"]
        126.9
    """
    if not accelerator_type:
        return None
    name = _GPU_ALIASES.get(accelerator_type.upper(), accelerator_type.upper())
    if name not in GPUS:
        return None
    g = dict(GPUS[name])
    fraction = XLA_GPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    g.update(model=name, memory_fraction=fraction, memory_gb=round(g["hbm_gb"] * fraction, 6))
    return g


def tpu_figures(version: str, devices_per_chip: int = 1) -> Optional[dict]:
    """Per-JAX-device defaults for a TPU version (`tpu_topology.normalize_version`), or None.

    Example:
        >>> f = tpu_figures("v5litepod")
        >>> f["memory_gb"], f["tflops"], f["ici_gbps"]
        (16.0, 197.0, 25.0)
    """
    t = TPUS.get(version)
    if t is None:
        return None
    d = max(1, devices_per_chip)
    return {"model": version, "memory_gb": t["hbm_gb"] / d, "tflops": t["tflops"] / d,
            "memory_bandwidth_gbps": t["memory_bandwidth_gbps"] / d,
            "ici_gbps": t["ici_chip_gbit"] / 8 / (2 * t["ici_links"])}
