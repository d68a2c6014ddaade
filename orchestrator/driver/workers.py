"""Which process is which: the run's live `workers.json`.

While a run is on, `ps` and Ray's dashboard show a column of `ray::StageWorker` processes;
nothing says which stage and host each one is. `write_workers` writes, into the run
directory, one record per stage actor of the current attempt — stage, host, cluster host
(placement bundle), actor name and namespace, pid, Ray node id, node IP and host name, the
devices it holds and its node's metrics endpoint — right after the actors are set up, and
again after each restart (the file is replaced atomically, `restart` says which attempt it
describes). The driver prints where the file is and, for a few actors, the lines themselves.

    {"run": "gpt-tiny", "restart": 0, "updated": 1796560503.2, "namespace": "meshpipe-gpt-tiny",
     "workers": [{"stage": 0, "host": 0, "cluster_host": 0, "actor": "gpt-tiny/stage0/host0",
                  "pid": 4242, "node_id": "ab12…", "node_ip": "10.0.0.5", "hostname": "gpu-a",
                  "devices": 2, "metrics": "http://10.0.0.5:44217/metrics"}, …]}

What the actors report at setup (`PipelineExecutor.info`) is joined with Ray's node table
(`ray.nodes()`) by node id; a field Ray does not give is null. Writing it never fails the run.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from orchestrator.core.private_fs import write_private

log = logging.getLogger("meshpipe")

FILE = "workers.json"
PRINTED = 8          # at most this many actors are printed one per line; the file has them all

__all__ = ["FILE", "metrics_line", "workers_record", "write_workers", "worker_lines"]


def workers_record(run: str, info: list[dict], nodes: list[dict], restart: int) -> dict:
    """The document `write_workers` writes (pure): `info` the actors' setup records, `nodes` Ray's
    node table (`ray.nodes()` rows: NodeID, NodeManagerAddress, NodeManagerHostname, MetricsExportPort).

    Example:
        >>> rec = workers_record("r", [{"stage": 0, "host": 0, "pid": 7, "node_id": "n1", "devices": 2,
        ...                              "bundle": 0}],
        ...                      [{"NodeID": "n1", "NodeManagerAddress": "10.0.0.5",
        ...                        "NodeManagerHostname": "a", "MetricsExportPort": 9}], 0)
        >>> w = rec["workers"][0]; (w["actor"], w["node_ip"], w["metrics"])
        ('r/stage0/host0', '10.0.0.5', 'http://10.0.0.5:9/metrics')
    """
    by_id = {n.get("NodeID"): n for n in nodes}
    workers = []
    for rec in sorted(info, key=lambda r: (r.get("stage", 0), r.get("host", 0))):
        node = by_id.get(rec.get("node_id")) or {}
        ip, port = node.get("NodeManagerAddress"), node.get("MetricsExportPort")
        workers.append({"stage": rec.get("stage"), "host": rec.get("host"), "cluster_host": rec.get("bundle"),
                        "actor": f"{run}/stage{rec.get('stage')}/host{rec.get('host')}",
                        "pid": rec.get("pid"), "node_id": rec.get("node_id"), "node_ip": ip,
                        "hostname": node.get("NodeManagerHostname"), "devices": rec.get("devices"),
                        "metrics": f"http://{ip}:{port}/metrics" if ip and port else None})
    return {"run": run, "restart": restart, "updated": time.time(), "namespace": f"meshpipe-{run}",
            "workers": workers}


def worker_lines(doc: dict) -> list[str]:
    """One line per actor (`PRINTED` at most), e.g. 'stage 0 host 0: pid 4242 on 10.0.0.5 (gpu-a)'."""
    out = [f"stage {w['stage']} host {w['host']}: pid {w['pid']} on {w['node_ip'] or '?'}"
           + (f" ({w['hostname']})" if w.get("hostname") else "") for w in doc["workers"][:PRINTED]]
    if len(doc["workers"]) > PRINTED:
        out.append(f"... and {len(doc['workers']) - PRINTED} more")
    return out


def write_workers(out: Path, run: str, info: list[dict], restart: int, echo: Callable[[str], None]) -> None:
    """Write `<out>/workers.json` for the attempt whose actors `info` describes and say so (module
    docstring). Called by the runner after each attempt's actors are up; never raises."""
    try:
        import ray

        doc = workers_record(run, info, ray.nodes(), restart)
        path = write_private(Path(out) / FILE, json.dumps(doc, indent=1))
    except Exception as e:  # noqa: BLE001 - an aid; the run goes on without it
        log.warning("could not write %s: %s", Path(out) / FILE, e)
        return
    echo(f"workers {path}" + ("" if not restart else f" (restart {restart})"))
    for line in worker_lines(doc):
        echo(f"  {line}")


def metrics_line(endpoints: list[str]) -> str:
    """The run's metrics endpoints as printed at its start (the first, and how many more).

    >>> print(metrics_line(["http://10.0.0.5:9/metrics", "http://10.0.0.6:9/metrics"]))
    metrics (Prometheus text format) http://10.0.0.5:9/metrics and 1 more node(s); workers.json lists each actor's
    """
    more = f" and {len(endpoints) - 1} more node(s); workers.json lists each actor's" if len(endpoints) > 1 else ""
    return f"metrics (Prometheus text format) {endpoints[0]}{more}"
