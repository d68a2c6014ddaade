"""How a stage process joins its submesh's JAX world, as data (pure).

Basic flow:
  driver   `backend.jax_init(...)` → a `JaxInit` value → serialised into the
           actor's environment (`MESHPIPE_JAX_INIT`) by `placement.actor_options`.
  worker   `stages.jaxinit.initialize(stage_hosts, host, coordinator, timeout_s)`
           reads the value back and calls `jax.distributed.initialize`
           accordingly, then checks that jax gave this process the index the
           plan expects.

Modes:
  none      one process per submesh: no `jax.distributed` at all.
  explicit  coordinator address (host 0 of the stage picks a free port),
            num_processes, process_id[, local_device_ids] — CPU (gloo), GPU
            (NCCL) and TPU subslices.
  auto      `jax.distributed.initialize()` without arguments: JAX's cluster
            auto-detection (on Cloud TPU: worker id, worker list and, across
            slices, the MEGASCALE_* variables) — whole TPU slices.

Nothing here imports ray or (at module level) jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

__all__ = ["JaxInit", "ENV_KEY"]

ENV_KEY = "MESHPIPE_JAX_INIT"
_MODES = ("none", "explicit", "auto")


@dataclass(frozen=True)
class JaxInit:
    """How one stage process initialises jax across the hosts of its submesh.

    Attributes:
      mode: "none" | "explicit" | "auto" (see the module docstring).
      num_processes: processes in the submesh's JAX world (the stage's hosts).
      process_id: this process's index there (= its host index in the stage).
      local_device_ids: devices this process drives (GPU: 0..n-1 of the GPUs
        Ray made visible); None lets jax use every visible device.

    Example:
        >>> JaxInit.from_env(JaxInit("explicit", 2, 1, (0, 1)).to_env())
        JaxInit(mode='explicit', num_processes=2, process_id=1, local_device_ids=(0, 1))
    """

    mode: str = "none"
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"JaxInit.mode {self.mode!r} must be one of {_MODES}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"JaxInit.process_id {self.process_id} is outside [0, {self.num_processes})")

    def to_env(self) -> str:
        return json.dumps({"mode": self.mode, "num_processes": self.num_processes,
                           "process_id": self.process_id,
                           "local_device_ids": list(self.local_device_ids)
                           if self.local_device_ids is not None else None}, sort_keys=True)

    @staticmethod
    def from_env(text: str) -> "JaxInit":
        d = json.loads(text)
        ids = d.get("local_device_ids")
        return JaxInit(d["mode"], int(d["num_processes"]), int(d["process_id"]),
                       tuple(ids) if ids is not None else None)

    def kwargs(self, coordinator: Optional[str], timeout_s: float) -> dict:
        """Keyword arguments for `jax.distributed.initialize` ({} for mode "none": no call at all)."""
        if self.mode == "none":
            return {}
        kw = {"initialization_timeout": int(timeout_s)}
        if self.mode == "explicit":
            if not coordinator:
                raise ValueError("explicit jax.distributed initialisation needs a coordinator address")
            # bind the coordinator on the address the other hosts use, not on all interfaces
            # (JAX's default): on an embedded cluster that is 127.0.0.1
            kw.update(coordinator_address=coordinator, coordinator_bind_address=coordinator,
                      num_processes=self.num_processes, process_id=self.process_id)
            if self.local_device_ids is not None:
                kw["local_device_ids"] = list(self.local_device_ids)
        return kw

    def to_dict(self) -> dict:
        return json.loads(self.to_env())
