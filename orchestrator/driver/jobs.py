"""`meshpipe submit/status/logs`: a run as a Ray Job, through the Ray Jobs SDK.

Basic flow of `submit`:
  1. The job and cluster files are loaded and checked here, as `meshpipe run`
     would (errors exit 2 before anything is sent).
  2. `package(...)` decides what travels: the files the job needs
     (`orchestrator.driver.shipping`: the job and cluster files, the code the job names
     and the local modules it imports, the data), relative to the working dir = the
     directory holding the job YAML (or `--working-dir`), copied into a fresh directory
     that is the runtime_env `working_dir` (never earlier runs, checkpoints, caches or a
     venv beside the job); their size is printed and bounded; the entrypoint is
     `meshpipe run <job, relative to it> [--cluster <cluster, relative>]
     --address auto --set ...`: inside the job the driver connects to the
     cluster it runs on (Ray Jobs sets RAY_ADDRESS) instead of starting Ray.
     Paths the job reads (`data.path`) must lie inside the working dir and are
     rewritten relative to it; a relative `run.output_dir` is made absolute
     when the cluster is this machine (loopback address), so results land where
     `meshpipe run` would put them; otherwise it stays inside the job's
     temporary working dir on the head node and a warning says so. A relative
     `checkpoint.dir` is treated the same way. A job with `checkpoint:` runs as
     `meshpipe run ... --resume auto`: Ray Jobs does not retry a failed job
     itself (retrying is the submitter's: submit the same job again), and the
     same entrypoint run again continues from the newest committed step (or
     starts at step 0 when none was committed), in the latest run directory.
  3. `find_dashboard` finds the cluster's dashboard (Jobs API) when no --address is given:
     RAY_API_SERVER_ADDRESS, RAY_ADDRESS (a dashboard URL, or the GCS address whose cluster
     is asked for its dashboard), else the cluster `ray start` last started on this machine
     (Ray's own record) — never a guessed port, which an embedded Ray of a `meshpipe run`
     may hold instead of the cluster meant.
  4. `client()` connects with Ray's token (see `auth_headers`), submits, prints
     the submission id and the `ray job status/logs` commands, then follows the
     logs (`--follow`, default), waits (`--no-follow`) or returns (`--no-wait`).
  5. The exit code is the job's outcome (`EXIT_CODES`).

Code on the cluster: the entrypoint runs the `meshpipe` command, so the meshpipe
package (and jax, optax) must be installed in the Python environment the Ray
cluster runs (true for a local cluster started from this venv, and for a cluster
image with meshpipe installed); the working dir ships only the job's files, not
the code, so the cluster runs the code it has installed.

Token: Ray 2.60 turns token authentication on by default; its dashboard REST API
answers 401 without `Authorization: Bearer <token>`. `auth_headers` finds the
token where Ray's own CLI and `ray.init` do (Ray's `AuthenticationTokenLoader`:
`RAY_AUTH_TOKEN`, then the file named by `RAY_AUTH_TOKEN_PATH`, then
`~/.ray/auth_token`) and sends it unless `RAY_AUTH_MODE=disabled` is set by the
user. meshpipe never turns authentication off and never prints the token.

Every HTTP call is bounded (`HTTP_TIMEOUT_S`); waiting for a job has no overall
limit unless `--timeout` is given (a training run may take days), but each poll
is bounded and Ctrl-C stops only the waiting, not the job.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}
EXIT_CONFIG, EXIT_CONNECT, EXIT_TIMEOUT, EXIT_UNKNOWN, EXIT_INTERRUPTED = 2, 4, 5, 6, 130
TERMINAL = frozenset(EXIT_CODES)
HTTP_TIMEOUT_S = 30.0
POLL_S = 1.0
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class JobsError(RuntimeError):
    """A problem talking to the cluster; `code` is the exit code to use."""

    def __init__(self, message: str, code: int = EXIT_CONNECT):
        super().__init__(message)
        self.code = code


# -- the token ---------------------------------------------------------------
def auth_headers() -> tuple[dict[str, str], str]:
    """({"authorization": "Bearer …"} or {}, a sentence saying where it came from — never the token)."""
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "disabled":
        return {}, "RAY_AUTH_MODE=disabled is set: no Ray auth token sent"
    from orchestrator.driver.ray_internals import token_source

    source = token_source()
    headers: dict[str, str] = {}
    from orchestrator.driver.ray_internals import auth_headers_from_ray

    headers = auth_headers_from_ray()
    if headers is None:   # a Ray whose loader is missing or changed: read the same places ourselves
        token = _read_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
    if not headers:
        return {}, ("no Ray auth token found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); "
                    "sending none")
    return headers, f"using the Ray auth token from {source or 'Ray’s token loader'}"


def _read_token() -> str | None:
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


# -- what travels ------------------------------------------------------------
@dataclass(frozen=True)
class Package:
    """A submission, as data: what `submit_job` receives, plus warnings for the user."""

    run: str
    working_dir: str
    entrypoint: str
    runtime_env: dict           # its working_dir: the user's; `submit` uploads a staged copy of `shipment`
    submission_id: str
    warnings: tuple[str, ...] = field(default_factory=tuple)
    shipment: Any = None        # shipping.Shipment: the files that travel


def package(checked, job_path: str, cluster_path: str | None, overrides: tuple[str, ...],
            address: str, working_dir: str | None = None, submission_id: str | None = None,
            include: tuple[str, ...] = (), limit_bytes: int | None = None) -> Package:
    """Decide the files, entrypoint and runtime_env of a submission (reads the file system, sends nothing).

    `include`: more paths to ship (files the job's code opens itself); `limit_bytes`: the most
    the files may come to (default `shipping.LIMIT_BYTES`).

    Raises:
      JobsError(code=2): a file the job needs lies outside the working dir or is missing, or the
        files come to more than the limit.

    Example:
      >>> from orchestrator.core.config import check_job, load_cluster, load_job
      >>> checked = check_job(load_job("examples/mlp.yaml"), load_cluster("cluster_configs/local.yaml"))
      >>> p = package(checked, "examples/mlp.yaml", None, ("run.steps=3",), "http://10.0.0.5:8265",
      ...             submission_id="meshpipe-x")
      >>> p.entrypoint
      'meshpipe run mlp.yaml --address auto --set run.steps=3'
      >>> Path(p.runtime_env["working_dir"]).name
      'examples'
    """
    from orchestrator.driver import shipping

    job = checked.job
    wd = Path(working_dir or Path(job_path).resolve().parent).resolve()
    sets = list(overrides)
    try:
        shipment = shipping.needed_files(checked, job_path, cluster_path, wd, include)
        warnings: list[str] = shipping.check_size(shipment, limit_bytes or shipping.LIMIT_BYTES)
    except shipping.ShippingError as e:
        raise JobsError(str(e), code=EXIT_CONFIG) from None

    def inside(path: Path, what: str, key: str) -> str:
        try:
            return path.resolve().relative_to(wd).as_posix()
        except ValueError:
            raise JobsError(f"{what} {path} is outside the working dir {wd} that the job ships to the "
                            f"cluster ({key}); pass --working-dir with a directory that holds both "
                            f"(e.g. --working-dir .)", code=EXIT_CONFIG) from None

    args = ["meshpipe", "run", inside(Path(job_path), "the job file", "JOB")]
    if cluster_path:
        args += ["--cluster", inside(Path(cluster_path), "the cluster file", "--cluster")]
    args += ["--address", "auto"]
    if job.checkpoint is not None:      # a retry (the same submission again) continues the run
        args += ["--resume", "auto"]
    if isinstance(job.data.path, str):      # (only the sources that read files take a path)
        src = Path(checked.data_path or job.data.path)
        sets.append(f"data.path={inside(src, 'the data file', 'data.path')}")
    elif job.data.path is not None:         # several files: the list, each relative to the working dir
        sets.append("data.path=" + json.dumps([inside(Path(p), "the data file", "data.path") for p in job.data.path]))
    if job.data.eval is not None and job.data.eval.path is not None:
        ev = job.data.eval.path
        sets.append("data.eval.path=" + (inside(Path(ev), "the eval file", "data.eval.path") if isinstance(ev, str)
                                         else json.dumps([inside(Path(p), "the eval file", "data.eval.path")
                                                          for p in ev])))
    if job.data.tokenizer:
        sets.append(f"data.tokenizer={inside(Path(job.data.tokenizer), 'the tokenizer file', 'data.tokenizer')}")
    dirs = [("run.output_dir", job.run.output_dir, "keep the results")]
    if job.checkpoint is not None:
        dirs.append(("checkpoint.dir", job.checkpoint.dir, "keep the checkpoints (and resume from them)"))
    for key, value, why in dirs:
        if Path(value).is_absolute():
            continue
        if _is_loopback(address):
            sets.append(f"{key}={Path(value).resolve()}")
        else:
            warnings.append(f"{key} = {value!r} is relative: on the cluster it lands inside the job's "
                            f"temporary working dir on the head node; pass --set {key}=/an/absolute/path "
                            f"to {why}")
    for s in sets:
        args += ["--set", s]
    sid = submission_id or f"meshpipe-{job.run.name}-{secrets.token_hex(4)}"
    runtime_env = {"working_dir": str(wd), "env_vars": {"PYTHONUNBUFFERED": "1"}}
    return Package(run=job.run.name, working_dir=str(wd), entrypoint=shlex.join(args),
                   runtime_env=runtime_env, submission_id=sid, warnings=tuple(warnings), shipment=shipment)


def _is_loopback(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in LOOPBACK or host.startswith("127.")


# -- finding the cluster ---------------------------------------------------------
def find_dashboard(address: str | None) -> tuple[str, str]:
    """(the Ray dashboard URL to talk to, where it came from); module docstring, step 3.

    Raises:
      JobsError(code=4): no address given and no cluster found, or the one found did not say
        where its dashboard is.
    """
    from orchestrator.driver.ray_internals import current_cluster, dashboard_of_gcs

    if address:
        return (address if "://" in address else f"http://{address}"), "--address / RAY_API_SERVER_ADDRESS"
    hint = "pass --address http://HEAD:8265 (the head's dashboard) or set RAY_API_SERVER_ADDRESS"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env.startswith(("http://", "https://")):
        return env, "RAY_ADDRESS"
    if env.startswith("ray://"):
        raise JobsError(f"RAY_ADDRESS = {env!r} is a Ray Client address; submitting needs the dashboard: {hint}")
    if env and env != "auto":
        gcs, via = env, "RAY_ADDRESS"
    else:
        gcs, via = current_cluster(), "the cluster `ray start` last started on this machine"
    if not gcs:
        raise JobsError(f"no Ray cluster given or found: {hint} (on the head, `ray start --head` prints it)")
    url, why = dashboard_of_gcs(gcs)
    if url is None:
        raise JobsError(f"{via}, GCS {gcs}, did not say where its dashboard is ({why}): {hint}")
    return url, f"{via} (GCS {gcs})"


# -- talking to the cluster ----------------------------------------------------
def bounded(fn: Callable[..., Any], *args, timeout: float = HTTP_TIMEOUT_S, what: str = "request") -> Any:
    """fn(*args) in a daemon thread; JobsError if it takes longer than `timeout`."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def target():
        try:
            box.put((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.put((False, e))

    threading.Thread(target=target, daemon=True, name=f"meshpipe-{what}").start()
    try:
        ok, value = box.get(timeout=timeout)
    except queue.Empty:
        raise JobsError(f"{what}: no answer within {timeout:.0f} s") from None
    if not ok:
        raise value
    return value


def client(address: str):
    """A `JobSubmissionClient` with the token header; JobsError with a readable cause otherwise."""
    from ray.job_submission import JobSubmissionClient

    headers, _ = auth_headers()
    warning = cleartext_token_warning(address, bool(headers))
    if warning:
        logging.getLogger("meshpipe").warning(warning)

    def make():
        # Ray's client takes RAY_API_SERVER_ADDRESS, then RAY_ADDRESS, over the address it is given
        # (`get_address_for_submission_client`); a GCS address in RAY_ADDRESS would send it through
        # Ray's own lookup, which rewrites a loopback head to the routable address and retries for
        # minutes. The address is already resolved (`find_dashboard`): make it the one Ray reads.
        before = os.environ.get("RAY_API_SERVER_ADDRESS")
        os.environ["RAY_API_SERVER_ADDRESS"] = address
        try:
            return JobSubmissionClient(address, headers=headers)
        finally:
            if before is None:
                os.environ.pop("RAY_API_SERVER_ADDRESS", None)
            else:
                os.environ["RAY_API_SERVER_ADDRESS"] = before

    try:
        return bounded(make, what=f"connecting to {address}")
    except JobsError:
        raise
    except Exception as e:  # noqa: BLE001 - Ray raises several types; name the cause
        raise JobsError(explain(e, address)) from None


def cleartext_token_warning(address: str, token_sent: bool) -> str | None:
    """A warning when the Ray token would travel over plain http to a non-loopback host, else None.

    Example:
        >>> cleartext_token_warning("http://127.0.0.1:8265", True) is None
        True
        >>> cleartext_token_warning("10.0.0.5:8265", True).split(":")[0]
        'the Ray auth token goes to 10.0.0.5 over plain http (no TLS)'
    """
    scheme = urlparse(address).scheme if "://" in address else "http"
    if not token_sent or scheme not in ("http", "ray") or _is_loopback(address):
        return None
    host = urlparse(address if "://" in address else f"http://{address}").hostname
    return (f"the Ray auth token goes to {host} over plain http (no TLS): anyone on the path can read it "
            "and then run code on that cluster. Use an SSH tunnel (--address http://127.0.0.1:8265 "
            "after `ssh -N -L 8265:127.0.0.1:8265 head`) or an https address behind a TLS proxy")


def explain(e: Exception, address: str) -> str:
    """A one-paragraph reason for a failed request, auth problems spelled out."""
    text = str(e)
    _, where = auth_headers()
    if "Authentication failed" in text or "403" in text or "Forbidden" in text:
        return (f"the Ray cluster at {address} refused the authentication token ({where}): it is not "
                "this cluster's token. Use the token the cluster was started with (on its head node: "
                "`ray get-auth-token`) via RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.")
    if "Authentication required" in text or "401" in text or "Unauthorized" in text:
        return (f"the Ray cluster at {address} requires token authentication and {where}. Provide the "
                "cluster's token via RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.")
    first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return f"cannot reach the Ray dashboard at {address}: {first}"


def unknown_job(e: Exception, address: str, submission_id: str) -> JobsError | None:
    """JobsError(code 6) when the dashboard answered that `submission_id` does not exist, else None."""
    text = str(e)
    if "404" in text and "does not exist" in text:
        return JobsError(f"no job {submission_id!r} on the Ray cluster at {address} "
                         f"(`meshpipe jobs --address {address}` lists the submitted runs)", code=EXIT_UNKNOWN)
    return None


def job_table(rows) -> list[str]:
    """One line per submitted job (submission id, status, meshpipe run, start time), oldest first."""
    import datetime

    def start(j):
        return getattr(j, "start_time", None) or 0

    lines = [f"{'SUBMISSION ID':<36} {'STATUS':<10} {'RUN':<20} STARTED (UTC)"]
    for j in sorted(rows, key=start):
        run = (getattr(j, "metadata", None) or {}).get("meshpipe_run", "-")
        when = (datetime.datetime.fromtimestamp(start(j) / 1000, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                if start(j) else "-")
        status = str(j.status).split(".")[-1]
        lines.append(f"{j.submission_id or j.job_id or '-':<36} {status:<10} {run:<20} {when}")
    if len(lines) == 1:
        lines.append("(no jobs submitted)")
    return lines


def status_of(c, sid: str) -> str:
    return str(bounded(c.get_job_status, sid, what="job status")).split(".")[-1]


def wait_for_end(c, sid: str, timeout: float | None = None) -> str:
    """Poll the job's status until it is terminal (or `timeout`, JobsError code 5)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = status_of(c, sid)
        if status in TERMINAL:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise JobsError(f"job {sid} still {status} after {timeout:.0f} s (it keeps running)",
                            code=EXIT_TIMEOUT)
        time.sleep(POLL_S)


def follow(c, sid: str, out: Callable[[str], None], timeout: float | None = None) -> str:
    """Stream the job's logs until it ends; returns the final status."""
    import asyncio

    async def run() -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        agen = c.tail_job_logs(sid)
        pending = None
        ended_at = None
        while True:
            if pending is None:
                pending = asyncio.ensure_future(agen.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=POLL_S * 5)
            if pending in done:
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    break
                pending = None
                out(chunk)
                continue
            status = await asyncio.to_thread(status_of, c, sid)
            if status in TERMINAL:
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > 10:   # the log stream lags the end: give it 10 s
                    break
            if deadline is not None and time.monotonic() > deadline:
                pending.cancel()
                raise JobsError(f"job {sid} still {status} after {timeout:.0f} s (it keeps running)",
                                code=EXIT_TIMEOUT)
        if pending is not None and not pending.done():
            pending.cancel()
        return await asyncio.to_thread(wait_for_end, c, sid, 60.0)

    return asyncio.run(run())


def commands(sid: str, address: str, token_sent: bool) -> list[str]:
    """What a person can type to look at the job."""
    prefix = "RAY_AUTH_MODE=token " if token_sent and os.environ.get("RAY_AUTH_MODE", "") != "token" else ""
    return [f"meshpipe status {sid} --address {address}",
            f"meshpipe logs {sid} --address {address} --follow",
            f"{prefix}ray job status {sid} --address {address}",
            f"{prefix}ray job logs {sid} --address {address} --follow",
            f"{prefix}ray job stop {sid} --address {address}"]
