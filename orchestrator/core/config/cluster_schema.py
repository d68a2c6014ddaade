"""The typed cluster configuration (`cluster.yaml`) and the job's `timeouts:` section.

Per-value rules only; the checks that need the job and the cluster together live in `check.py`.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional

from pydantic import Field, field_validator, model_validator

from orchestrator.core.backends import get_backend
from orchestrator.core.backends.tpu_topology import TpuTypeError, geometry
from orchestrator.core.config.errors import Problem
from orchestrator.core.config.fields import (HOSTPORT_RE, NonNegFloat, PosFloat, PosInt, Frozen)


class TimeoutsConfig(Frozen):
    """`timeouts:` (seconds, all > 0): every remote wait has a deadline."""

    init_s: PosFloat = 120.0
    step_s: PosFloat = 600.0
    shutdown_s: PosFloat = 30.0
    jax_distributed_init_s: PosFloat = 60.0


class GpuConfig(Frozen):
    """`gpu:` (platform gpu, optional) — what the GPU nodes are and how XLA uses their memory."""

    gpus_per_node: Optional[PosInt] = None       # checked against devices_per_host at load (null: at placement)
    accelerator_type: Optional[str] = None       # Ray's accelerator_type:<T> resource, e.g. H100 (null: any)
    memory_fraction: Optional[float] = None      # XLA_PYTHON_CLIENT_MEM_FRACTION (null: XLA's default, 0.75)
    preallocate: bool = True                     # XLA_PYTHON_CLIENT_PREALLOCATE

    @field_validator("memory_fraction")
    @classmethod
    def _fraction(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not 0 < v <= 1:
            raise Problem("must be in (0, 1]: the fraction of each GPU's memory XLA may use")
        return v

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator_type(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", v):
            raise Problem("must be a Ray accelerator type name, e.g. H100, A100, L4 (see ray.util.accelerators)")
        return v


class TpuConfig(Frozen):
    """`tpu:` (platform tpu, required) — the TPU slice type the cluster is made of."""

    type: str                                   # GCP accelerator type, e.g. v5litepod-16, v6e-16, v4-16
    topology: str                               # chips, e.g. 4x4 (v5e/v6e) or 2x2x2 (v4/v5p)
    slices: PosInt = 1                          # slices of that type (more than 1: stages across slices / DCN)
    chips_per_host: Optional[PosInt] = None     # override Ray's default (4, or 8 for single-VM v5e/v6e)

    @model_validator(mode="after")
    def _geometry(self) -> "TpuConfig":
        try:
            geometry(self.type, self.topology, self.chips_per_host)
        except TpuTypeError as e:
            raise Problem(str(e), (e.key,), getattr(self, e.key)) from None
        return self


class AlphaBetaConfig(Frozen):
    """An α-β pair: t(bytes) = latency + bytes / bandwidth. `per_array_us` (collectives only,
    optional, default 0): what each further array of one combined all-reduce adds, µs."""

    bandwidth_gbps: PosFloat      # GB/s (1e9 bytes per second) per device on this link
    latency_us: NonNegFloat       # per message, microseconds
    per_array_us: Optional[NonNegFloat] = None


class LinkClassConfig(AlphaBetaConfig):
    """One link class of `links:` for the planner's α-β model: t(bytes) = latency + bytes / bandwidth.

    `collectives` (group and dcn): the α-β of JAX collectives over a mesh axis that spans
    hosts of this class (one multi-process JAX world: gloo on CPU, NCCL on GPU), when they
    differ from the stage-to-stage sends the link's own figures describe (`meshpipe calibrate`
    measures both); null: the link's own figures.
    """

    collectives: Optional[AlphaBetaConfig] = None


class LinksConfig(Frozen):
    """`links:` (optional; `meshpipe plan --auto` only) — the cluster's link classes.

    `host`: between devices of one host; `group`: between hosts of one node group
    (an NVLink/ICI domain: `hosts_per_group` consecutive hosts; a TPU slice);
    `dcn`: between node groups. Left out: the platform's nominal defaults
    (`orchestrator.core.planner.topology`).
    """

    host: Optional[LinkClassConfig] = None
    group: Optional[LinkClassConfig] = None
    dcn: Optional[LinkClassConfig] = None
    hosts_per_group: Optional[PosInt] = None


class DeviceConfig(Frozen):
    """`device:` (optional; `meshpipe plan --auto` only) — what one device can hold and do."""

    memory_gb: Optional[PosFloat] = None      # bytes the planner may fill per device (1e9 bytes)
    tflops: Optional[PosFloat] = None         # sustained float32 TFLOP/s per device, every host computing
    memory_bandwidth_gbps: Optional[PosFloat] = None   # GB/s per device, every host computing
    # the same with only ONE host computing (`meshpipe calibrate`: host 0 alone); the record, not
    # charged (the cost model charges tflops / memory_bandwidth_gbps). They differ where hosts share hardware.
    lone_tflops: Optional[PosFloat] = None
    lone_memory_bandwidth_gbps: Optional[PosFloat] = None
    # fixed runtime cost of one pipeline action (F, B, OPT) on a stage, microseconds: dispatch,
    # interpreter, spans, transport bookkeeping (`meshpipe calibrate` measures it; null: 0)
    action_overhead_us: Optional[NonNegFloat] = None
    # fixed runtime cost of one stage-to-stage transfer (its SEND and RECV) beyond the link's α-β time,
    # microseconds: wake-ups, mailbox, framing (`meshpipe calibrate` measures it; null: 0)
    transfer_overhead_us: Optional[NonNegFloat] = None
    # one kernel's time (a compiled program's fusion, dot, copy, collective) beyond its flops and
    # bytes, microseconds, every host computing / host 0 alone (`meshpipe calibrate`; null: 0 / the former)
    kernel_overhead_us: Optional[NonNegFloat] = None
    lone_kernel_overhead_us: Optional[NonNegFloat] = None
    # how many times slower a stage-sized program runs with every host computing than on host 0
    # alone (`meshpipe calibrate`); plans on more than one host have their device time charged
    # this many times. 1 where hosts do not share hardware (null: 1)
    shared_slowdown: Optional[Annotated[float, Field(ge=1, allow_inf_nan=False)]] = None


class TransportTlsConfig(Frozen):
    """`transport_tls:` (optional; `transport: socket`) — TLS with mutual certificate checks on the
    transport's TCP links (`orchestrator.core.tls`). Absolute paths, the same on every node: each
    stage actor opens them where it runs. The files are checked before any actor starts."""

    cert_file: str    # this node's certificate (PEM), signed by ca_file
    key_file: str     # its private key (PEM, unencrypted; readable only by the user running Ray)
    ca_file: str      # the cluster's own CA (PEM): a peer must present a certificate it signed

    @field_validator("cert_file", "key_file", "ca_file")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or any(ord(c) < 32 for c in v):
            raise Problem("must be an absolute path (each stage actor opens it on its own node)")
        return v


# `transport: auto` on CPU: the transport benchmarks/transport.py measured faster for the `large`
# 1F1B step on one CPU machine (docs/drafts/transports.md gives the figures)
AUTO_CPU = "socket"


def resolve_transport(transport: str, platform: str) -> str:
    """The concrete transport for cluster `transport` on `platform`: "auto" is XLA's device-to-device
    transfers on accelerators and `AUTO_CPU` on CPU.

    Example:
        >>> resolve_transport("auto", "gpu"), resolve_transport("auto", "cpu"), resolve_transport("ray", "tpu")
        ('xla', 'socket', 'ray')
    """
    if transport != "auto":
        return transport
    return AUTO_CPU if platform == "cpu" else "xla"


class ClusterConfig(Frozen):
    """A cluster (`cluster.yaml`): which Ray, what platform, how many hosts of how many devices."""

    address: Optional[str] = None
    platform: Literal["cpu", "gpu", "tpu"] = "cpu"
    hosts: PosInt
    devices_per_host: PosInt
    cpus_per_host: PosFloat = 1.0
    resources_per_host: dict[str, NonNegFloat] = Field(default_factory=dict)
    num_cpus: Optional[PosInt] = None
    dashboard_host: str = "127.0.0.1"
    node_ip_address: str = "127.0.0.1"  # embedded Ray only: 127.0.0.1 keeps every Ray port on loopback
    env_vars: dict[str, str] = Field(default_factory=dict, repr=False)  # stage actors' env; redacted in output
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    pin_cpus: bool = False   # pin each host actor to one core of its node (host index mod cores)
    # stage-to-stage tensors (`data_plane`): "auto" (the default: xla on GPU/TPU, AUTO_CPU on CPU), "xla" (one
    # JAX world, XLA's device-to-device transfers), "socket" (framed TCP / Unix sockets) or "ray" (actor calls)
    transport: Literal["auto", "xla", "socket", "ray"] = "auto"
    # socket transport, peers on the same machine: "unix" (abstract Unix socket + shared memory, the
    # default) or "tcp" (the same TCP links as between machines, and so TLS when transport_tls is set)
    transport_same_machine: Literal["unix", "tcp"] = "unix"
    transport_tls: TransportTlsConfig | None = None   # socket transport: TLS on its TCP links (null: none)
    # how the driver triggers steps (orchestrator.driver.dispatch): a Ray call per actor per steps_per_call
    # steps (default), the same as a Ray Compiled Graph, or a Ray call per action (the slow reference)
    executor: Literal["step_calls", "compiled_graph", "action_calls"] = "step_calls"
    steps_per_call: Optional[PosInt] = None   # step_calls / compiled_graph; None: 4 (action_calls: 1)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    gpu: Optional[GpuConfig] = None   # platform gpu only
    tpu: Optional[TpuConfig] = None   # platform tpu only (required there)
    links: Optional[LinksConfig] = None     # link classes for the auto-planner (null: platform defaults)
    device: Optional[DeviceConfig] = None   # device memory/speed for the auto-planner (null: defaults)

    RESERVED_RESOURCES: ClassVar[frozenset[str]] = frozenset({"CPU", "GPU", "TPU", "memory",
                                                               "object_store_memory"})
    MESHPIPE_ENV: ClassVar[frozenset[str]] = frozenset({"XLA_FLAGS", "JAX_PLATFORMS",
                                                         "PYTHONUNBUFFERED", "MESHPIPE_JAX_INIT"})

    @field_validator("address")
    @classmethod
    def _address(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v == "auto":
            return v
        m = HOSTPORT_RE.match(v)
        if not m or not 1 <= int(m.group(3)) <= 65535:
            raise Problem("must be null (embedded Ray started by meshpipe), 'auto', "
                          "'ray://host:port' or 'host:port' (port 1-65535)")
        return v

    @field_validator("resources_per_host", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            for k in v:
                if k in cls.RESERVED_RESOURCES:
                    raise Problem(f"{k!r} is reserved by Ray; CPUs come from cpus_per_host and "
                                  "accelerators from platform/devices_per_host", (k,), v[k])
        return v

    @field_validator("dashboard_host", "node_ip_address")
    @classmethod
    def _dashboard_host(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v) or "\x00" in v:
            raise Problem("must be a host name or IP address (no spaces), e.g. 127.0.0.1")
        return v

    @field_validator("node_ip_address")
    @classmethod
    def _node_ip(cls, v: str) -> str:
        if v in ("0.0.0.0", "::", "[::]"):
            raise Problem("must be the address other machines reach this one at (Ray advertises it), "
                          "not a wildcard; 127.0.0.1 (the default) keeps every Ray port on loopback")
        return v

    @field_validator("env_vars", mode="before")
    @classmethod
    def _env_vars(cls, v: Any) -> Any:
        """Environment variables for every stage actor (Ray runtime_env); numbers become strings."""
        if not isinstance(v, Mapping):
            return v
        out = {}
        for k, val in v.items():
            if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise Problem("must be an environment variable name (letters, digits, '_'; not "
                              "starting with a digit)", (k,), val)
            if k in cls.MESHPIPE_ENV:
                raise Problem(f"{k} is set by meshpipe for each actor (simulated devices, platform); "
                              "it cannot be overridden here", (k,), val)
            if isinstance(val, bool) or not isinstance(val, (str, int, float)):
                raise Problem("must be a string (quote it: environment values are text)", (k,), val)
            out[k] = str(val)
        return out

    @model_validator(mode="after")
    def _cpus(self) -> "ClusterConfig":
        if self.num_cpus is not None and self.address is not None:
            raise Problem("only for an embedded cluster (address: null); a running cluster "
                          "declares its own CPUs", ("num_cpus",), self.num_cpus)
        need = self.hosts * self.cpus_per_host
        if self.num_cpus is not None and need > self.num_cpus + 1e-9:
            raise Problem(f"too few CPUs: hosts × cpus_per_host = {self.hosts} × {self.cpus_per_host} "
                          f"= {need:g} CPUs do not fit in num_cpus = {self.num_cpus}; the placement "
                          "group would wait forever", ("num_cpus",), self.num_cpus)
        return self

    @property
    def data_plane(self) -> str:
        """The transport stage edges use: `transport`, with "auto" resolved (`resolve_transport`)."""
        return resolve_transport(self.transport, self.platform)

    @model_validator(mode="after")
    def _transport_options(self) -> ClusterConfig:
        plane = self.data_plane
        shown = self.transport if plane == self.transport else f"{self.transport} ({plane} on {self.platform})"
        for key, value, default in (("transport_same_machine", self.transport_same_machine, "unix"),
                                    ("transport_tls", self.transport_tls, None)):
            if plane != "socket" and value != default:
                raise Problem(f"only for transport: socket (this cluster is transport: {shown}); "
                              "remove it", (key,), value if not hasattr(value, "model_dump") else value.model_dump())
        return self

    @model_validator(mode="after")
    def _steps_per_call(self) -> "ClusterConfig":
        if self.executor == "action_calls" and self.steps_per_call not in (None, 1):
            raise Problem("must be 1 (or left out) with executor: action_calls, which makes one Ray call "
                          "per action", ("steps_per_call",), self.steps_per_call)
        return self

    @model_validator(mode="after")
    def _links(self) -> "ClusterConfig":
        g = self.links.hosts_per_group if self.links is not None else None
        if g is not None and self.hosts % g:
            raise Problem(f"must divide cluster.hosts = {self.hosts}: node groups are equal runs of "
                          "consecutive hosts", ("links", "hosts_per_group"), g)
        return self

    @property
    def calls_of_steps(self) -> int:
        """Steps per executor call: steps_per_call, or 4 (1 for action_calls) when left out."""
        if self.steps_per_call is not None:
            return self.steps_per_call
        return 1 if self.executor == "action_calls" else 4

    @model_validator(mode="after")
    def _platform(self) -> "ClusterConfig":
        """The platform's section and its backend's cluster rules (orchestrator.core.backends)."""
        for name in ("gpu", "tpu"):
            if getattr(self, name) is not None and self.platform != name:
                raise Problem(f"only for platform: {name} (this cluster is platform: {self.platform}); "
                              "remove it", (name,), getattr(self, name).model_dump(mode="json"))
        if self.platform == "tpu" and self.tpu is None:
            raise Problem("required for platform: tpu: the slice type, e.g. {type: v5litepod-16, "
                          "topology: 4x4}", ("tpu",), None)
        for key, value, rule in get_backend(self).check_cluster()[:1]:
            raise Problem(rule, tuple(key.split(".")), value)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; `parse_cluster(c.to_dict()) == c`."""
        return self.model_dump(mode="json")
