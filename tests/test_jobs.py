"""`meshpipe submit` against a real, separately started Ray head with token authentication.

Isolation (why these tests may share a pytest process with the `ray_local` ones):
  - the head is `ray start --head --block` in its own session, own --temp-dir
    (short, under /tmp: Ray's socket paths must stay < 108 bytes) and free
    ports for everything, including the dashboard agent and the metrics export
    port. Nothing here calls `ray.init`: submit runs as a subprocess and this
    process talks HTTP only (Jobs SDK, state REST API, metrics endpoint), always
    with the token header.
  - stopping: SIGTERM to the `--block` process, which tears down the Ray
    processes it started (Ray's own shutdown hook); then any process still
    carrying this head's token path in its environment (only ours do) is killed
    by pid. Never `ray stop`, which would stop every Ray on the machine.
  - auth as Ray sets it by default: RAY_AUTH_MODE=token, with a fresh token in
    a file named by RAY_AUTH_TOKEN_PATH (so ~/.ray/auth_token is neither needed
    nor touched). `RAY_metrics_report_interval_ms=2000` makes metrics visible
    within seconds (Ray's default is 10 s).
One submitted run (MLP example, 3 steps) is observed while it runs (actors,
metrics) and reused by every check below.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from orchestrator.driver.metrics import parse_prometheus
from orchestrator.driver.ray_internals import SINGLE_MACHINE_VAR, beyond_loopback
from orchestrator.core.schedule import Action, Kind
from tests.conftest import free_port, wait_until

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RUN = "mlp-tiny"
STAGES, MICROBATCHES, STEPS = 3, 4, 3
ACTORS = {f"{RUN}/stage{s}/host0" for s in range(STAGES)}
METRICS = {   # name as scraped → tag keys it must carry (besides Ray's own)
    "ray_meshpipe_step_time_s": {"run"},
    "ray_meshpipe_samples_per_s": {"run"},
    "ray_meshpipe_bubble_measured": {"run"},
    "ray_meshpipe_bubble_simulated": {"run"},
    "ray_meshpipe_restarts": {"run"},
    "ray_meshpipe_steps_done": {"run"},
    "ray_meshpipe_busy_fraction": {"run", "stage", "host"},
    "ray_meshpipe_memory_bytes": {"run", "stage", "host", "source"},
    "ray_meshpipe_compile_time_s": {"run", "stage", "host"},
    "ray_meshpipe_reshard_bytes_total": {"run", "stage", "host", "edge"},
}


@dataclass
class Head:
    dashboard: str
    metrics_url: str
    token: str
    token_path: str
    tmp: str
    proc: subprocess.Popen
    gcs: str = ""

    def get(self, path: str, timeout: float = 10.0):
        req = urllib.request.Request(self.dashboard + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def env(self, **extra) -> dict:
        """Environment for a meshpipe subprocess: the head's token via RAY_AUTH_TOKEN_PATH only."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_API_SERVER_ADDRESS")}
        env.update(RAY_AUTH_TOKEN_PATH=self.token_path, PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
        env.update(extra)
        return env

    def alive_actors(self) -> dict[str, str]:
        q = urllib.parse.urlencode({"limit": 1000, "detail": 1, "filter_keys": "state",
                                    "filter_predicates": "=", "filter_values": "ALIVE"})
        rows = self.get(f"/api/v0/actors?{q}")["data"]["result"]["result"]
        return {a["name"]: a.get("ray_namespace") for a in rows if a.get("name")}

    def scrape(self) -> list[tuple[str, dict, float]]:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
                return parse_prometheus(r.read().decode("utf-8", "replace"))
        except OSError:
            return []


def beyond_loopback_of(head: "Head") -> list[str]:
    """Listening sockets of this head's processes (the `--block` process, what it started, and
    anything else carrying its token path: the job's driver and actors) beyond loopback."""
    found = set()
    for pid in {head.proc.pid, *_ours(head.token_path)}:
        try:
            found.update(beyond_loopback(root_pid=pid))
        except psutil.Error:      # a process that exited meanwhile
            continue
    return sorted(found)


def _ours(token_path: str) -> list[int]:
    """Pids of processes whose environment names this head's token file (started by this head)."""
    needle = f"RAY_AUTH_TOKEN_PATH={token_path}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            zombie = (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if not zombie and needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except (OSError, IndexError):
            continue
    return pids


@pytest.fixture(scope="module")
def head():
    if not (BIN / "ray").exists():
        pytest.skip("the ray CLI is not installed next to this Python")
    tmp = tempfile.mkdtemp(prefix="mp-head-", dir="/tmp")
    token = secrets.token_hex(32)
    token_path = os.path.join(tmp, "token")
    with open(os.open(token_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(token)
    ports = {name: free_port() for name in ("port", "dashboard-port", "metrics-export-port",
                                             "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                             "runtime-env-agent-port", "node-manager-port",
                                             "object-manager-port", "ray-client-server-port")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path, RAY_metrics_report_interval_ms="2000",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")   # the job entrypoint runs `meshpipe`
    # loopback only (as tests/clusters.py): the node address, and Ray's single-machine mode so that
    # neither its servers nor the job's driver turn 127.0.0.1 back into the routable address
    env[SINGLE_MACHINE_VAR] = "0"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=4", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1",
           "--include-dashboard=true", "--disable-usage-stats", f"--temp-dir={tmp}/ray",
           "--object-store-memory=300000000", *[f"--{k}={v}" for k, v in ports.items()]]
    log = open(os.path.join(tmp, "head.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    h = Head(dashboard=f"http://127.0.0.1:{ports['dashboard-port']}",
             metrics_url=f"http://127.0.0.1:{ports['metrics-export-port']}/metrics",
             token=token, token_path=token_path, tmp=tmp, proc=proc, gcs=f"127.0.0.1:{ports['port']}")

    def jobs_api_up():
        if proc.poll() is not None:
            raise AssertionError(f"ray start exited {proc.returncode}: {Path(tmp, 'head.log').read_text()[-2000:]}")
        try:
            h.get("/api/jobs/", timeout=2)
            return True
        except (OSError, ValueError):
            return False

    try:
        wait_until(jobs_api_up, 90, "the Ray head's Jobs API", every=0.25)
        assert not beyond_loopback_of(h), beyond_loopback_of(h)
        yield h
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in _ours(token_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:   # none of them may write into tmp after it is removed
            wait_until(lambda: not _ours(token_path), 30, "this head's processes to exit")
        finally:
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Submitted:
    rc: int
    stdout: str
    stderr: str
    out_dir: Path
    actors_seen: dict = field(default_factory=dict)      # name → namespace, while running
    actors_after: set = field(default_factory=set)
    samples: list = field(default_factory=list)          # (name, labels, value) of our metrics
    exposed: set = field(default_factory=set)            # listening sockets beyond loopback, while running

    @property
    def record(self) -> Path:
        """The run's directory (`out_dir` is the run name's; the run writes into <out_dir>/<run id>/)."""
        from tests.records import run_dir

        return run_dir(self.out_dir.parent, self.out_dir.name)

    @property
    def submission_id(self) -> str:
        return next(w for w in self.stdout.split() if w.startswith(f"meshpipe-{RUN}-"))


def _seen_all_metrics(samples) -> bool:
    names = {n for n, labels, _ in samples}
    return set(METRICS) <= names


@pytest.fixture(scope="module")
def submitted(head, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("submit-out")
    # no --address: the dashboard is found through the cluster's GCS (RAY_ADDRESS), as `ray job` does
    cmd = [str(BIN / "meshpipe"), "submit", "examples/mlp.yaml", "--set", f"run.steps={STEPS}",
           "--set", f"run.output_dir={out_dir}"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=head.env(RAY_ADDRESS=head.gcs), stdout=out, stderr=err)
        seen: dict = {}
        samples: dict = {}
        exposed: set = set()
        deadline = time.monotonic() + 240
        ended = None
        while time.monotonic() < deadline:        # watch the run: actors and metrics
            try:
                seen.update({n: ns for n, ns in head.alive_actors().items() if n in ACTORS})
            except (OSError, ValueError, KeyError):
                pass
            exposed.update(beyond_loopback_of(head))
            for n, labels, v in head.scrape():
                if n.startswith("ray_meshpipe_") and labels.get("run") == RUN:
                    samples[(n, tuple(sorted(labels.items())))] = (n, labels, v)
            if proc.poll() is not None:
                ended = ended or time.monotonic()
                if _seen_all_metrics(samples.values()) or time.monotonic() - ended > 20:
                    break
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait(timeout=30)
        out.seek(0)
        err.seek(0)
        result = Submitted(rc=rc, stdout=out.read(), stderr=err.read(), out_dir=out_dir / RUN,
                           actors_seen=seen, samples=list(samples.values()), exposed=exposed)
    try:
        wait_until(lambda: not set(head.alive_actors()) & ACTORS, 60, "the run's actors to exit")
    except AssertionError:
        pass
    result.actors_after = set(head.alive_actors()) & ACTORS
    return result


def test_submit_succeeds_prints_how_to_follow_and_exits_with_the_outcome(head, submitted):
    assert submitted.rc == 0, submitted.stdout + submitted.stderr
    # the dashboard found through the GCS RAY_ADDRESS names, not a guessed port; only the job file
    # travels (a built-in model on synthetic data), not the rest of examples/
    assert f"Ray dashboard {head.dashboard} (from RAY_ADDRESS (GCS {head.gcs}))" in submitted.stderr, submitted.stderr
    assert "shipping 1 file(s)" in submitted.stderr and ": mlp.yaml" in submitted.stderr, submitted.stderr
    sid = submitted.submission_id
    for cmd in (f"ray job status {sid} --address {head.dashboard}", f"ray job logs {sid}",
                f"meshpipe status {sid}"):
        assert cmd in submitted.stdout
    for step in range(STEPS):
        assert f"step {step:>4d}  loss" in submitted.stdout         # followed logs, one line per step
    assert f"job {sid}: SUCCEEDED" in submitted.stdout
    assert "using the Ray auth token from RAY_AUTH_TOKEN_PATH" in submitted.stderr
    assert head.token not in submitted.stdout + submitted.stderr
    summary = json.loads((submitted.record / "summary.json").read_text())
    assert len(summary["losses"]) == STEPS and summary["ray"]["namespace"] == f"meshpipe-{RUN}"


def test_the_head_and_the_run_listen_on_loopback_only(head, submitted):
    """`ray start --head --node-ip-address=127.0.0.1`: no process of the head, nor the job's
    driver and stage actors, listens beyond loopback (sampled while the run went on)."""
    assert submitted.rc == 0, submitted.stderr
    assert not submitted.exposed, sorted(submitted.exposed)
    assert not beyond_loopback_of(head)


def test_status_and_logs_commands_and_the_jobs_sdk_agree(head, submitted):
    from ray.job_submission import JobStatus, JobSubmissionClient

    sid = submitted.submission_id
    client = JobSubmissionClient(head.dashboard, headers={"Authorization": f"Bearer {head.token}"})
    assert client.get_job_status(sid) == JobStatus.SUCCEEDED
    logs = client.get_job_logs(sid)
    assert all(f"step {s:>4d}  loss" in logs for s in range(STEPS)) and "\r" not in logs
    st = subprocess.run([str(BIN / "meshpipe"), "status", sid, "--address", head.dashboard],
                        env=head.env(), capture_output=True, text=True, timeout=60)
    assert st.returncode == 0 and f"{sid}: SUCCEEDED" in st.stdout
    lg = subprocess.run([str(BIN / "meshpipe"), "logs", sid, "--address", head.dashboard],
                        env=head.env(), capture_output=True, text=True, timeout=60)
    assert lg.returncode == 0 and "step    2  loss" in lg.stdout


@pytest.mark.parametrize("case", ["wrong token", "no token"])
def test_submit_without_the_right_token_is_refused_clearly(head, case, tmp_path):
    env = head.env(RAY_AUTH_TOKEN="0" * 64) if case == "wrong token" else head.env(HOME=str(tmp_path))
    if case == "no token":
        env.pop("RAY_AUTH_TOKEN_PATH")
    r = subprocess.run([str(BIN / "meshpipe"), "submit", "examples/mlp.yaml", "--address", head.dashboard,
                        "--no-wait"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stdout + r.stderr
    expected = "refused the authentication token" if case == "wrong token" else "requires token authentication"
    assert expected in r.stderr and "RAY_AUTH_TOKEN" in r.stderr
    assert "submitted" not in r.stdout and "0" * 64 not in r.stdout + r.stderr


def test_state_api_lists_the_named_actors_while_running_and_none_after(submitted):
    assert submitted.actors_seen == {name: f"meshpipe-{RUN}" for name in ACTORS}
    assert submitted.actors_after == set()


@pytest.mark.ray_260
def test_metrics_endpoint_has_every_metric_with_its_tags(submitted):
    by_name: dict = {}
    for name, labels, value in submitted.samples:
        by_name.setdefault(name, []).append((labels, value))
    assert set(METRICS) <= set(by_name), sorted(set(METRICS) - set(by_name))
    for name, keys in METRICS.items():
        for labels, _ in by_name[name]:
            assert keys <= set(labels), (name, labels)
            assert "microbatch" not in labels and "step" not in labels
    stages = lambda name: {lab["stage"] for lab, _ in by_name[name]}  # noqa: E731
    assert stages("ray_meshpipe_busy_fraction") == {str(s) for s in range(STAGES)}
    assert stages("ray_meshpipe_compile_time_s") == {str(s) for s in range(STAGES)}
    edges = {lab["edge"]: v for lab, v in by_name["ray_meshpipe_reshard_bytes_total"]}
    assert set(edges) == {"0->1", "1->2", "1->0", "2->1"} and min(edges.values()) > 0
    assert {lab["source"] for lab, _ in by_name["ray_meshpipe_memory_bytes"]} == {"process_rss"}  # CPU
    assert max(v for _, v in by_name["ray_meshpipe_steps_done"]) == STEPS


def test_trace_has_one_span_per_compute_action_and_a_png_timeline(submitted):
    trace = json.loads((submitted.record / "trace.json").read_text())
    work = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    compute = [e for e in work if Action.parse(e["args"]["action"]).kind in (Kind.F, Kind.B)]
    per_step: dict = {}
    for e in compute:
        per_step.setdefault(e["args"]["step"], set()).add(e["args"]["action"])
    assert sorted(per_step) == list(range(STEPS))
    for step, actions in per_step.items():                   # stages × microbatches × {F, B}, each once
        assert len(actions) == STAGES * MICROBATCHES * 2
    assert len(compute) == STEPS * STAGES * MICROBATCHES * 2
    by_host: dict = {}
    for e in work:
        by_host.setdefault((e["pid"], e["tid"]), []).append(e)
    assert sorted(by_host) == [(s, 0) for s in range(STAGES)]
    for events in by_host.values():                          # actions of a host never overlap
        for a, b in zip(events, events[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1.0, (a, b)  # 1 µs: float rounding of the epoch times
    png = (submitted.record / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 400 and height > 200


def test_a_failed_job_makes_submit_exit_non_zero(head, tmp_path):
    # the cluster asks for a resource the head lacks: placement refuses (or gives up after init_s): FAILED
    shutil.copy(ROOT / "examples/mlp.yaml", tmp_path / "job.yaml")
    cluster = (ROOT / "cluster_configs/local.yaml").read_text()
    cluster = cluster.replace("resources_per_host: {}", "resources_per_host: {meshpipe_test_missing: 1}")
    cluster = cluster.replace("init_s: 120", "init_s: 3")
    assert "meshpipe_test_missing" in cluster and "init_s: 3" in cluster
    (tmp_path / "cluster.yaml").write_text(cluster)
    r = subprocess.run([str(BIN / "meshpipe"), "submit", str(tmp_path / "job.yaml"), "--cluster",
                        str(tmp_path / "cluster.yaml"), "--set", f"run.output_dir={tmp_path / 'out'}",
                        "--address", head.dashboard, "--no-follow", "--timeout", "150"],
                       cwd=ROOT, env=head.env(), capture_output=True, text=True, timeout=200)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ": FAILED" in r.stdout and "step    0" not in r.stdout     # --no-follow: status only


def _cli(head, *args) -> subprocess.CompletedProcess:
    """This checkout's CLI (not the installed `meshpipe`), with the head's token."""
    return subprocess.run([sys.executable, "-m", "orchestrator.driver.cli", *args], cwd=ROOT,
                          env={**head.env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)


def test_jobs_lists_the_run_and_status_of_an_unknown_id_says_it_is_unknown(head, submitted):
    ls = _cli(head, "jobs", "--address", head.dashboard)
    assert ls.returncode == 0, ls.stderr
    row = next(ln for ln in ls.stdout.splitlines() if ln.startswith(submitted.submission_id))
    assert "SUCCEEDED" in row and RUN in row
    st = _cli(head, "status", "meshpipe-no-such-run", "--address", head.dashboard)
    assert st.returncode == 6, st.stdout + st.stderr
    assert "no job 'meshpipe-no-such-run'" in st.stderr and "cannot reach" not in st.stderr


def test_the_dashboard_takes_the_token_the_way_the_readme_says(head):
    """What the dashboard's token prompt does: POST /api/authenticate with the token sets the
    `ray-authentication-token` cookie, and that cookie alone then opens the API."""
    req = urllib.request.Request(head.dashboard + "/api/authenticate", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {head.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        cookie = r.headers.get("Set-Cookie", "")
    assert cookie.startswith(f"ray-authentication-token={head.token}") and "HttpOnly" in cookie
    with urllib.request.urlopen(urllib.request.Request(head.dashboard + "/api/jobs/", headers={
            "Cookie": f"ray-authentication-token={head.token}"}), timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as no_cookie:
        urllib.request.urlopen(head.dashboard + "/api/jobs/", timeout=10)
    assert no_cookie.value.code == 401
