"""`meshpipe plan --auto` on a cluster nobody measured: calibrate it first, once, and cache that.

The cost model prices a plan from the cluster's `device:` and `links:` figures. A cluster file
without them is planned from nominal per-platform figures (`planner.topology.DEFAULTS`), which
know nothing of this machine's runtime overheads: on a 2-core VM they predicted 6.8 ms per step
where the run took 243–433 ms, and picked a plan 3.7x slower than a hand-written one. So:

  - figures given (the file carries every figure `meshpipe calibrate` measures): plan from them;
  - else a cached calibration of the same cluster on the same machine, if one exists: plan
    from it (the output says which file and when it was measured);
  - else calibrate now (`orchestrator.driver.calibrate`: a few minutes, it starts Ray), write
    the result to the cache and plan from it;
  - `--no-calibrate`: plan from the nominal figures anyway, and say so (every printed and
    written prediction is marked nominal, with the command that measures the cluster).

The cache: `$XDG_CACHE_HOME/meshpipe/calibrated/<key>.yaml` (default `~/.cache/...`), one file
per key; the key hashes the cluster file's bytes and the facts of the machine planning and
measuring it (host name, CPU model and count, platform, jax/jaxlib and meshpipe versions), so
an edited cluster file, another machine or an upgrade measures again. `--recalibrate` measures
again regardless. A cached file is an ordinary calibrated cluster YAML (`meshpipe calibrate`'s
output), usable with `--cluster` too.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

__all__ = ["Calibration", "MEASURED", "cache_dir", "cache_key", "host_facts", "nominal", "resolve"]

# what `meshpipe calibrate` measures and writes; a cluster missing any is planned from nominal figures
MEASURED = ("device.tflops", "device.memory_bandwidth_gbps", "device.action_overhead_us", "links.host")
MEASURED_ACROSS_HOSTS = ("device.transfer_overhead_us", "links.dcn")


@dataclass(frozen=True)
class Calibration:
    """What the planner priced with: `source` "given" (the cluster file's own figures), "cached",
    "measured" (now) or "nominal" (`--no-calibrate`); `cluster` the file planned with; `missing`
    the figures the input file lacked."""

    source: str
    cluster: str
    missing: tuple[str, ...] = ()
    cache: Optional[str] = None
    measured_at: Optional[str] = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_nominal(self) -> bool:
        return self.source == "nominal"

    def to_json(self) -> dict:
        return {"source": self.source, "cluster": self.cluster, "missing": list(self.missing), "cache": self.cache,
                "measured_at": self.measured_at}


def nominal(cluster) -> tuple[str, ...]:
    """The figures `meshpipe calibrate` measures that `cluster` (a ClusterConfig) does not give.

    >>> from orchestrator.core.config import load_cluster
    >>> nominal(load_cluster("cluster_configs/local.yaml"))[:2]
    ('device.tflops', 'device.memory_bandwidth_gbps')
    """
    dev, links = getattr(cluster, "device", None), getattr(cluster, "links", None)
    want = MEASURED + (MEASURED_ACROSS_HOSTS if cluster.hosts > 1 else ())
    missing = []
    for key in want:
        section, name = key.split(".")
        holder = dev if section == "device" else links
        if name == "dcn" and links is not None and getattr(links, "group", None) is not None:
            continue       # node groups: `group` is the cross-host class measured
        if holder is None or getattr(holder, name, None) is None:
            missing.append(key)
    return tuple(missing)


def host_facts() -> dict:
    """The machine-dependent part of the cache key."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "?"

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"host": platform.node(), "machine": platform.machine(), "system": platform.system(), "cpu": cpu,
            "cpus": os.cpu_count(), "jax": ver("jax"), "jaxlib": ver("jaxlib"), "meshpipe": ver("meshpipe")}


def cache_key(cluster_bytes: bytes, facts: dict) -> str:
    """sha256 over the cluster file's bytes and the host facts (16 hex digits).

    >>> cache_key(b"hosts: 2\\n", {"host": "a"}) == cache_key(b"hosts: 2\\n", {"host": "a"})
    True
    >>> cache_key(b"hosts: 2\\n", {"host": "a"}) == cache_key(b"hosts: 4\\n", {"host": "a"})
    False
    """
    h = hashlib.sha256(cluster_bytes)
    h.update(json.dumps(facts, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshpipe" / "calibrated"


def resolve(cluster_path: str, *, calibrate: bool = True, recalibrate: bool = False,
            echo: Callable[[str], None] = print) -> Calibration:
    """The cluster file to plan with (module docstring); may run `meshpipe calibrate` (starts Ray).

    Raises what `orchestrator.driver.calibrate.calibrate` raises (ConfigError, CalibrationError,
    PlacementError, TimeoutError, RuntimeError).
    """
    from orchestrator.core.config import load_cluster
    from orchestrator.core.private_fs import private_dir

    cluster = load_cluster(cluster_path)
    missing = nominal(cluster)
    if not missing:
        return Calibration("given", cluster_path)
    command = f"meshpipe calibrate --cluster {cluster_path}"
    if not calibrate:
        echo(f"WARNING: {cluster_path} does not give {', '.join(missing)}: planning from NOMINAL figures "
             f"(--no-calibrate); predictions can be off by 10x or more. `{command}` measures them "
             "(or drop --no-calibrate)")
        return Calibration("nominal", cluster_path, missing)
    cached = private_dir(cache_dir()) / f"{cache_key(Path(cluster_path).read_bytes(), host_facts())}.yaml"
    if cached.is_file() and not recalibrate:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cached.stat().st_mtime))
        echo(f"planning with the calibration of {cluster_path} measured {when}, cached at {cached} "
             "(--recalibrate measures again)")
        return Calibration("cached", str(cached), missing, str(cached), when)
    from orchestrator.driver.calibrate import calibrate as run_calibration

    echo(f"{cluster_path} does not give {', '.join(missing)}: calibrating it first ({command}; a few "
         f"minutes, once: cached at {cached}; --no-calibrate plans from nominal figures instead)")
    report = run_calibration(cluster_path, out=str(cached), force=True, echo=echo)
    return Calibration("measured", report["written"], missing, str(cached), time.strftime("%Y-%m-%d %H:%M"))
