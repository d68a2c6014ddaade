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

    init_s: PosFloat = Field(120.0, description="Starting or connecting to Ray, reserving the placement, "
                                                "creating the actors and their first jax import.")
    step_s: PosFloat = Field(600.0, description="One training step, the first compile included; once steps are "
                                                "measured the progress deadline is max(30 s, 3 × the median "
                                                "step), never above this.")
    shutdown_s: PosFloat = Field(30.0, description="Tearing the actors and an embedded Ray down.")
    jax_distributed_init_s: PosFloat = Field(60.0, description="`jax.distributed.initialize` of a multi-host "
                                                               "stage.")
    connect_s: PosFloat = Field(30.0, description="Connecting to a running Ray (`address`, `--address`): a "
                                                 "healthy connect takes a few seconds; past this the error names "
                                                 "the address Ray dialled.")
    factory_s: PosFloat = Field(120.0, description="The job's own code at plan time: a model or data factory is "
                                                   "imported and called in a child process within this many "
                                                   "seconds (a factory that blocks or exits early is refused).")


class GpuConfig(Frozen):
    """`gpu:` (platform gpu, optional) — what the GPU nodes are and how XLA uses their memory."""

    gpus_per_node: Optional[PosInt] = Field(None, description="GPUs per node: `devices_per_host` above it is "
                                                              "refused when the file loads (null: at placement).")
    accelerator_type: Optional[str] = Field(None, description="Require Ray's `accelerator_type:<T>` resource "
                                                              "(null: any GPU).", examples=["H100"])
    memory_fraction: Optional[float] = Field(None, description="`XLA_PYTHON_CLIENT_MEM_FRACTION` for each "
                                                               "actor, in (0, 1] (null: XLA's default, 0.75).")
    preallocate: bool = Field(True, description="`XLA_PYTHON_CLIENT_PREALLOCATE`: each actor owns its GPUs, so "
                                                "preallocation is safe.")

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

    type: str = Field(description="The GCP accelerator type.", examples=["v5litepod-16", "v6e-16", "v4-16"])
    topology: str = Field(description="The slice's chips.", examples=["4x4", "2x2x2"])
    slices: PosInt = Field(1, description="Slices of that type; more than 1: stages across slices join over DCN.")
    chips_per_host: Optional[PosInt] = Field(None, description="Override Ray's default chips per VM (4, or 8 "
                                                               "for single-VM v5e/v6e).")

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

    bandwidth_gbps: PosFloat = Field(description="GB/s (1e9 bytes per second) per device on this link.")
    latency_us: NonNegFloat = Field(description="Per message, microseconds.")
    per_array_us: Optional[NonNegFloat] = Field(
        None, description="Collectives: what each further array of one combined all-reduce adds, microseconds "
                          "(null: 0).")


class LinkClassConfig(AlphaBetaConfig):
    """One link class of `links:` for the planner's α-β model: t(bytes) = latency + bytes / bandwidth.

    `collectives` (group and dcn): the α-β of JAX collectives over a mesh axis that spans
    hosts of this class (one multi-process JAX world: gloo on CPU, NCCL on GPU), when they
    differ from the stage-to-stage sends the link's own figures describe (`meshpipe calibrate`
    measures both); null: the link's own figures.
    """

    collectives: Optional[AlphaBetaConfig] = Field(
        None, description="The α-β of JAX collectives over a mesh axis spanning hosts of this class, where they "
                          "differ from stage-to-stage sends (null: the link's own figures).")


class LinksConfig(Frozen):
    """`links:` (optional; `meshpipe plan --auto` only) — the cluster's link classes.

    `host`: between devices of one host; `group`: between hosts of one node group
    (an NVLink/ICI domain: `hosts_per_group` consecutive hosts; a TPU slice);
    `dcn`: between node groups. Their figures describe stage-edge transfers under THIS
    cluster's `transport` (what `meshpipe calibrate` measures). Left out: the nominal
    defaults of the platform under that transport (`orchestrator.core.planner.transports`).

    How the transport's SEND is charged (null: the transport's own figures — `ray` and
    `socket` 1 and 0 µs, `xla` 0 and 100 µs):
      send_blocking   fraction (0..1) of the device→host copy + the wire that the sender's
                      compute thread waits for.
      send_issue_us   the sender's compute-thread cost of issuing one SEND, µs.
      host_copy       α-β of one device↔host copy as the host-staged transports (ray,
                      socket) make them (null: the platform's default; none on CPU).
    """

    host: Optional[LinkClassConfig] = Field(None, description="Between devices of one host.")
    group: Optional[LinkClassConfig] = Field(None, description="Between hosts of one node group (an NVLink/ICI "
                                                               "domain; a TPU slice).")
    dcn: Optional[LinkClassConfig] = Field(None, description="Between node groups.")
    hosts_per_group: Optional[PosInt] = Field(None, description="Consecutive hosts per node group; must divide "
                                                                "`hosts`.")
    send_blocking: Optional[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] = Field(
        None, description="Fraction (0..1) of the device→host copy and the wire that a SEND holds the sender's "
                          "compute thread for (null: the transport's own figure: `ray`/`socket` 1, `xla` 0).")
    send_issue_us: Optional[NonNegFloat] = Field(
        None, description="The sender's compute-thread cost of issuing one SEND, µs (null: `ray`/`socket` 0, "
                          "`xla` 100).")
    host_copy: Optional[AlphaBetaConfig] = Field(
        None, description="α-β of one device↔host copy as the host-staged transports (`ray`, `socket`) make "
                          "them (null: the platform's default; none on CPU).")


class DeviceConfig(Frozen):
    """`device:` (optional; `meshpipe plan --auto` only) — what one device can hold and do."""

    memory_gb: Optional[PosFloat] = Field(None, description="What the planner may fill per device, GB (1e9 "
                                                            "bytes); null: the accelerator's data sheet × "
                                                            "`gpu.memory_fraction` (0.75: 60 for an H100).")
    tflops: Optional[PosFloat] = Field(None, description="Sustained float32 TFLOP/s per device, every host "
                                                         "computing (what the cost model charges).")
    memory_bandwidth_gbps: Optional[PosFloat] = Field(None, description="GB/s per device, every host computing.")
    lone_tflops: Optional[PosFloat] = Field(
        None, description="`tflops` with only host 0 computing (`meshpipe calibrate`); the record, not charged. "
                          "It differs where hosts share hardware.")
    lone_memory_bandwidth_gbps: Optional[PosFloat] = Field(
        None, description="`memory_bandwidth_gbps` with only host 0 computing; the record, not charged.")
    action_overhead_us: Optional[NonNegFloat] = Field(
        None, description="The runtime's fixed cost of one pipeline action (F, B, OPT) on a stage, microseconds: "
                          "dispatch, interpreter, spans, bookkeeping (`meshpipe calibrate` measures it; null: 0).")
    transfer_overhead_us: Optional[NonNegFloat] = Field(
        None, description="The fixed cost of one stage-to-stage transfer (its SEND and RECV) beyond the link's "
                          "α-β time, microseconds: wake-ups, mailbox, framing (null: 0).")
    kernel_overhead_us: Optional[NonNegFloat] = Field(
        None, description="One compiled kernel's time beyond its flops and bytes, microseconds, every host "
                          "computing (null: 0).")
    lone_kernel_overhead_us: Optional[NonNegFloat] = Field(
        None, description="`kernel_overhead_us` with host 0 alone (null: `kernel_overhead_us`).")
    shared_slowdown: Optional[Annotated[float, Field(ge=1, allow_inf_nan=False)]] = Field(
        None, description="How many times slower a stage-sized program runs with every host computing than on "
                          "host 0 alone; plans on more than one host have their device time charged this many "
                          "times. 1 where hosts do not share hardware (null: 1).")


class TransportTlsConfig(Frozen):
    """`transport_tls:` (optional; `transport: socket`) — TLS with mutual certificate checks on the
    transport's TCP links (`orchestrator.core.tls`). Absolute paths, the same on every node: each
    stage actor opens them where it runs. The files are checked before any actor starts."""

    cert_file: str = Field(description="This node's certificate (PEM), signed by `ca_file`.",
                           examples=["/etc/meshpipe/node.pem"])
    key_file: str = Field(description="Its private key (PEM, unencrypted; readable only by the user running Ray).")
    ca_file: str = Field(description="The cluster's own CA (PEM): a peer must present a certificate it signed.")

    @field_validator("cert_file", "key_file", "ca_file")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or any(ord(c) < 32 for c in v):
            raise Problem("must be an absolute path (each stage actor opens it on its own node)")
        return v


# `transport: auto` on CPU: the transport benchmarks/transport.py measured faster per edge between two
# processes of one CPU machine (docs/guides/transports.md, "Why `auto` is `socket` on CPU", gives the figures)
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

    address: Optional[str] = Field(None, description="null: meshpipe starts an embedded Ray on this machine "
                                                     "and stops it at the end; `auto`, `host:port` or "
                                                     "`ray://host:port`: a running cluster.", examples=["auto"])
    platform: Literal["cpu", "gpu", "tpu"] = Field("cpu", description="`cpu`: simulated XLA CPU devices; `gpu`: "
                                                                      "whole GPUs per host; `tpu`: TPU VMs of a "
                                                                      "slice (needs `tpu:`).")
    hosts: PosInt = Field(description="Hosts: one Ray placement-group bundle and one stage actor each.")
    devices_per_host: PosInt = Field(description="Devices per host (simulated CPU devices, GPUs or TPU chips).")
    cpus_per_host: PosFloat = Field(1.0, description="Ray CPUs reserved per host bundle (fractional, so several "
                                                     "simulated hosts fit on few cores).")
    resources_per_host: dict[str, NonNegFloat] = Field(default_factory=dict, description="Extra custom Ray "
                                                       "resources per host bundle (not CPU/GPU/TPU/memory).")
    num_cpus: Optional[PosInt] = Field(None, description="Embedded Ray only: logical CPUs declared to it "
                                                         "(null: Ray detects them).")
    dashboard_host: str = Field("127.0.0.1", description="Where the embedded Ray's dashboard listens; anything "
                                                         "but loopback exposes job submission (a warning says so).")
    node_ip_address: str = Field("127.0.0.1", description="Embedded Ray only: the address Ray binds and "
                                                          "advertises; 127.0.0.1 keeps every Ray port on loopback.")
    env_vars: dict[str, str] = Field(default_factory=dict, repr=False, description="Environment variables of "
                                     "every stage actor; redacted in output. `XLA_FLAGS`, `JAX_PLATFORMS` and "
                                     "meshpipe's own are set by meshpipe.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray's placement-group strategy for the host bundles.")
    pin_cpus: bool = Field(False, description="Pin each host actor to one core of its node (host index mod "
                                              "cores).")
    transport: Literal["auto", "xla", "socket", "ray"] = Field(
        "auto", description="Stage-to-stage tensors: `auto` (`xla` on GPU/TPU, `socket` on CPU), `xla` (one JAX "
                            "world per job, edges moved device to device by XLA's cross-host transfers), "
                            "`socket` (token-authenticated framed TCP, Unix socket + shared memory on one "
                            "machine) or `ray` (Ray actor-call arguments; the simple reference).")
    transport_same_machine: Literal["unix", "tcp"] = Field(
        "unix", description="Socket transport, peers on one machine: `unix` (abstract Unix socket + shared "
                            "memory) or `tcp` (the same TCP links as between machines, and so TLS when "
                            "`transport_tls` is set).")
    transport_tls: TransportTlsConfig | None = Field(None, description="Socket transport: TLS with mutual "
                                                                       "certificates on its TCP links (null: none).")
    executor: Literal["step_calls", "compiled_graph", "action_calls"] = Field(
        "step_calls", description="How the driver starts steps: one Ray call per actor per `steps_per_call` "
                                  "steps, the same as a Ray Compiled Graph, or one Ray call per action (the slow "
                                  "reference).")
    steps_per_call: Optional[PosInt] = Field(None, description="Steps per executor call (`step_calls`, "
                                                               "`compiled_graph`; null: 4; `action_calls`: 1). "
                                                               "Progress lines arrive that many at a time.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Deadlines, in seconds.")
    gpu: Optional[GpuConfig] = Field(None, description="GPU nodes (platform `gpu` only).")
    tpu: Optional[TpuConfig] = Field(None, description="The TPU slice type (platform `tpu` only, required there).")
    links: Optional[LinksConfig] = Field(None, description="Link classes for `meshpipe plan --auto` (null: the "
                                                           "platform's nominal figures; `meshpipe calibrate` "
                                                           "measures them).")
    device: Optional[DeviceConfig] = Field(None, description="Device memory and speed for `meshpipe plan --auto` "
                                                             "(null: nominal figures).")

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
