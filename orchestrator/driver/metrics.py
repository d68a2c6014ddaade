"""Run metrics for Prometheus via `ray.util.metrics`, recorded by the driver after each step.

Basic flow (`orchestrator.driver.runner`, only while Ray is connected):
  m = RunMetrics(run, simulated_bubble)  # starts the keeper thread (see below)
  per step: m.record(step_stats)        # a telemetry.StepStats with the actors' stats
  at the end (attached to a long-lived cluster only): m.flush()
  always, at the end: m.close()         # stops the keeper

Ray exports every metric with a `ray_` prefix on each node's metrics export port
(`ray.nodes()[i]["MetricsExportPort"]`, http://<node>:<port>/metrics), from where
Prometheus (and the dashboard's Grafana panels, when configured) read them:

  name (as scraped)                   type     tags                          what
  ray_meshpipe_step_time_s            gauge    run                           last step, driver wall time
  ray_meshpipe_samples_per_s          gauge    run                           global batch / step time
  ray_meshpipe_bubble_measured        gauge    run                           from the step's spans
  ray_meshpipe_bubble_simulated       gauge    run                           the plan's simulation
  ray_meshpipe_restarts               gauge    run                           re-placements so far
  ray_meshpipe_steps_done             gauge    run                           steps completed
  ray_meshpipe_busy_fraction          gauge    run, stage, host              compute share of the step
  ray_meshpipe_memory_bytes           gauge    run, stage, host, source      device bytes in use, or
                                                                             process RSS on CPU (source)
  ray_meshpipe_compile_time_s         gauge    run, stage, host              jax trace+lower+compile, total
  ray_meshpipe_reshard_bytes_total    counter  run, stage, host, edge        bytes this host sent over
                                                                             edge "s->t" (activations
                                                                             forward, gradients back)

Tags are bounded (no step or microbatch ids). Why the driver records: one place
that sees every stage's spans; the actors only return their numbers with the
step result. Ray exports a process's metrics every `metrics_report_interval_ms`
(10 s by default), and its metrics agent drops a gauge 2 intervals after the
last `set` (measured with Ray 2.60: a gauge set once was scraped for ~2 s at a
1 s interval, then never again). A run's gauges hold for minutes (`restarts`,
`hosts`, the last eval loss) and a step may outlast 2 intervals, so a keeper
thread sets every gauge's last value again each half interval until `close()`:
they stay on the endpoint for the whole run and age out after it. A driver
attached to a long-lived cluster waits at the end (`flush`, at most one interval
+ 2 s) until its own node's endpoint shows the final `steps_done`; with an
embedded Ray that stops with the run there is nothing to wait for.
"""
from __future__ import annotations

import threading
import time

RUN = ("run",)
HOST = ("run", "stage", "host")


class RunMetrics:
    """Creates the metrics lazily and records one step at a time. Needs a connected Ray."""

    def __init__(self, run: str, simulated_bubble: float, restarts: int = 0):
        from ray.util.metrics import Counter, Gauge

        self.run = run
        g = lambda name, desc, keys=RUN: Gauge(f"meshpipe_{name}", desc, tag_keys=keys)  # noqa: E731
        self.step_time = g("step_time_s", "Last pipeline step, wall time on the driver (s)")
        self.samples = g("samples_per_s", "Training samples per second (global batch / step time)")
        self.bubble_measured = g("bubble_measured", "Measured bubble fraction of the last step")
        self.bubble_simulated = g("bubble_simulated", "Simulated bubble fraction of the plan")
        self.restarts = g("restarts", "Times the run's actors were re-placed")
        self.steps_done = g("steps_done", "Steps completed")
        self.busy = g("busy_fraction", "Share of the step a stage host spent computing", HOST)
        self.memory = g("memory_bytes", "Memory in use by a stage host (source: device or process_rss)",
                        HOST + ("source",))
        self.compile = g("compile_time_s", "Seconds a stage host spent tracing/lowering/compiling", HOST)
        self.eval_loss = g("eval_loss", "Mean loss on the data.eval batches at the last evaluation")
        self.data_wait = g("data_wait_s", "Time a stage host's last step waited for its data loader (s)", HOST)
        from orchestrator.core.elastic import METRICS     # failure.elastic: hosts now, re-plans so far

        self.elastic = {m.name: g(m.name, m.description, m.tags) for m in METRICS}
        self.reshard = Counter("meshpipe_reshard_bytes", "Bytes a stage host sent to a neighbour stage",
                               tag_keys=HOST + ("edge",))
        self._sent: dict[tuple[int, int, str], int] = {}
        self._simulated = float(simulated_bubble)
        self._last: dict[tuple[int, tuple], tuple] = {}    # (gauge, tags) → (gauge, value, tags), last set
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.done = 0
        self.set_restarts(restarts)
        self._set(self.bubble_simulated, self._simulated, {"run": run})
        self._keeper = threading.Thread(target=self._keep, args=(export_interval_s() / 2,),
                                        name=f"meshpipe-metrics-{run}", daemon=True)
        self._keeper.start()

    def _set(self, gauge, value: float, tags: dict[str, str]) -> None:
        """Set a gauge and remember the value, which the keeper sets again until `close()`."""
        with self._lock:
            self._last[(id(gauge), tuple(sorted(tags.items())))] = (gauge, value, tags)
        gauge.set(value, tags=tags)

    def refresh(self) -> None:
        """Set every gauge's last value again (Ray's agent forgets a gauge 2 intervals after its last set)."""
        with self._lock:
            live = list(self._last.values())
        for gauge, value, tags in live:
            gauge.set(value, tags=tags)

    def _keep(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - metrics are an aid: a failed refresh waits for the next
                continue

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the keeper (the run's gauges then age out of the agent within 2 intervals)."""
        self._stop.set()
        self._keeper.join(timeout_s)

    def set_restarts(self, restarts: int) -> None:
        self._set(self.restarts, restarts, {"run": self.run})

    def record(self, st, eval_loss: float | None = None) -> None:
        """Record one `telemetry.StepStats` (and the step's eval loss, when it evaluated)."""
        run = {"run": self.run}
        if eval_loss is not None:
            self._set(self.eval_loss, eval_loss, run)
        self._set(self.step_time, st.wall_s, run)
        self._set(self.samples, st.samples_per_s, run)
        self._set(self.bubble_measured, st.measured_bubble, run)
        self._set(self.bubble_simulated, self._simulated, run)
        for (stage, host), frac in st.busy.items():
            self._set(self.busy, frac, _host(self.run, stage, host))
        for h in st.hosts:
            stage, host = h["stage"], h["host"]
            tags = _host(self.run, stage, host)
            if "memory_bytes" in h:
                self._set(self.memory, h["memory_bytes"], {**tags, "source": h.get("memory_source", "")})
            if "compile_s" in h:
                self._set(self.compile, h["compile_s"], tags)
            if "data_wait_s" in h:
                self._set(self.data_wait, h["data_wait_s"], tags)
            for direction, total in (h.get("sent_bytes_to") or {}).items():
                peer = int(direction)   # keyed by destination stage
                key = (stage, host, direction)
                delta = int(total) - self._sent.get(key, 0)
                self._sent[key] = int(total)
                if delta > 0:
                    self.reshard.inc(delta, tags={**tags, "edge": f"{stage}->{peer}"})
        self.done = st.step + 1
        self._set(self.steps_done, self.done, run)

    def plan(self, hosts: int, replans: int, simulated_bubble: float) -> None:
        """The plan in use (`failure.elastic`): its hosts, its simulated bubble, the re-plans so far."""
        self._simulated = float(simulated_bubble)
        self._set(self.bubble_simulated, self._simulated, {"run": self.run})
        self._set(self.elastic["hosts"], hosts, {"run": self.run})
        self._set(self.elastic["replans"], replans, {"run": self.run})

    def flush(self, cap_s: float = 15.0) -> bool:
        """Poll this node's metrics endpoint until it shows the final steps_done (bounded); True if seen."""
        deadline = time.monotonic() + min(cap_s, export_interval_s() + 2.0)
        url = local_endpoint()
        while time.monotonic() < deadline:
            if url and exported_value(url, "ray_meshpipe_steps_done", {"run": self.run}) == self.done:
                return True
            time.sleep(0.25)
        return False


def export_interval_s() -> float:
    """Ray's metrics export interval in this process (`RAY_metrics_report_interval_ms`, min 1 s)."""
    try:
        import ray

        return max(1.0, ray._config.metrics_report_interval_ms() / 1000.0)
    except Exception:  # noqa: BLE001 - private accessor; Ray's default otherwise
        return 10.0


def metrics_endpoints() -> list[str]:
    """http://<node ip>:<MetricsExportPort>/metrics of every live node of the connected cluster."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


def local_endpoint() -> str | None:
    """The metrics endpoint of the node this process runs on."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == me and n.get("MetricsExportPort"):
            return f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
    return None


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition.

    Example:
      >>> parse_prometheus('# HELP x y\\nray_a{run="r",stage="0"} 2.5\\nray_b 1')
      [('ray_a', {'run': 'r', 'stage': '0'}, 2.5), ('ray_b', {}, 1.0)]
    """
    import re

    out = []
    label_re = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, _, value = rest.rpartition("}")
            labels = dict(label_re.findall(labels_text))
        else:
            name, _, value = line.partition(" ")
            labels = {}
        try:
            out.append((name, labels, float(value.split()[0])))
        except (ValueError, IndexError):
            continue
    return out


def exported_value(url: str, name: str, tags: dict[str, str], timeout: float = 5.0) -> float | None:
    """The value of `name` with (at least) `tags` on the endpoint, or None (absent or unreachable)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    for n, labels, value in parse_prometheus(text):
        if n == name and all(labels.get(k) == v for k, v in tags.items()):
            return value
    return None


def _host(run: str, stage: int, host: int) -> dict[str, str]:
    return {"run": run, "stage": str(stage), "host": str(host)}
