"""Every use of a private Ray internal, in one module, each behind a guard.

meshpipe needs these things Ray has no public API for:
  - `single_machine_mode()`: Ray binds its core servers on the routable address unless
    its macOS/Windows single-machine switch is off; the switch is the environment
    variable RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER *and* the constant
    `ray._private.ray_constants.ENABLE_RAY_CLUSTER`, read at import time.
  - `auth_headers_from_ray()`: `ray._raylet.AuthenticationTokenLoader` finds the token
    where Ray's CLI does.
  - `token_auth_enabled()`: `ray._private.authentication.authentication_utils.is_token_auth_enabled`,
    for the "how to get in" hint printed at start.
  - `wrap_log_printer(wrap)`: Ray's forwarder of actor output to the driver
    (`ray._private.ray_logging.global_worker_stdstream_dispatcher`, its `_lock` and
    `handlers`), wrapped so known noise is dropped (`orchestrator.driver.quiet`).
  - `available_resources()`: `ray._private.state.available_resources_per_node`.
  - `dashboard_url()`: `ray._private.worker.get_dashboard_url`.
  - `current_cluster()`: `ray._private.utils.read_ray_address`, the GCS address of the cluster
    `ray start` last started on this machine; `dashboard_of_gcs(address)`: that cluster's
    dashboard URL, which its GCS keeps (`ray._raylet.GcsClient`, key `webui:url` of the
    `dashboard` namespace), asked in a subprocess with a deadline (`meshpipe submit` without
    --address).
  - `bootstrap_address(address)`: `ray._private.services.canonicalize_bootstrap_address`, the
    address `ray.init` really dials ("auto" resolved, a loopback host rewritten), so that
    `orchestrator.driver.connect` can probe it within a deadline and name it.
  - `embedded_session()`: `ray._private.worker._global_node`'s session directory and raylet
    pid, for the reaper that cleans up after a driver killed with its embedded cluster
    (`orchestrator.driver.reaper`).
  - `compiled_graph_proxy(graph)`: a Compiled Graph's `_proxy_actor`, a helper actor Ray
    starts on the driver's node and frees only when the graph object is garbage collected —
    which the refs a failed step leaves in a traceback can delay by a minute.
Each is looked up defensively: if a Ray upgrade renames it, the caller gets None (or,
for the loopback switch, a warning) and a safe fallback — never a crash and never a
silent exposure, because `beyond_loopback` verifies after start what the embedded
cluster actually binds, by listing its processes' listening sockets (psutil, which
ray[default] installs). `tests/test_ray_internals.py` fails loudly when any of these
internals disappears or changes its shape (`internal_problems`), naming it, so an upgrade
is noticed in CI rather than in production.

Version guard: TESTED_RAY is the range meshpipe was checked against (pyproject's pins).
`check_ray_version()`, called before Ray starts or is connected to, does nothing inside
it; outside it, it checks every internal's shape and warns naming what changed, and
refuses to start an embedded cluster when its loopback-only binding could be neither
set (the switch is gone) nor verified (no psutil to list the listening sockets).
"""
from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
from pathlib import Path

from orchestrator.core.backends import PlacementError   # pure: no ray, no jax

log = logging.getLogger("meshpipe")

TESTED_RAY_RANGE = ((2, 52, 1), (2, 61))    # [oldest, first untested): pyproject.toml's ray pins
TESTED_RAY = "2.52.1 to 2.60.x"
SINGLE_MACHINE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
INTERNALS = {   # what this module reaches into: (module, attribute) -> what for
    ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"): "embedded cluster bound to loopback",
    ("ray._raylet", "AuthenticationTokenLoader"): "the Ray auth token for `meshpipe submit/status/logs`",
    ("ray._private.state", "available_resources_per_node"): "free resources in placement pre-checks",
    ("ray._private.worker", "get_dashboard_url"): "the dashboard URL shown at start",
    ("ray._private.authentication.authentication_utils", "is_token_auth_enabled"):
        "whether to print the token hint at start",
    ("ray._private.ray_logging", "global_worker_stdstream_dispatcher"):
        "dropping known noise from the actor output forwarded to the driver",
    ("ray._private.utils", "read_ray_address"): "the cluster `ray start` last started here (submit without --address)",
    ("ray._raylet", "GcsClient"): "the dashboard address a cluster's GCS keeps (submit without --address)",
    ("ray._private.services", "canonicalize_bootstrap_address"):
        "the address `ray.init` really dials, probed and named within cluster.timeouts.connect_s",
}
LOOPBACK_SWITCH = ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")   # the one safety depends on


class RayVersionError(PlacementError):
    """This Ray is outside the tested range and lacks an internal that safety depends on."""


def _internal(module: str, name: str):
    """`module.name`, or None when this Ray lacks it (logged once per call site)."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        log.debug("Ray %s has no %s.%s", _ray_version(), module, name)
        return None


def _ray_version() -> str:
    try:
        import ray

        return ray.__version__
    except ImportError:   # pragma: no cover
        return "?"


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string.

    Example:
        >>> version_tuple("2.60.0"), version_tuple("2.61.0rc1"), version_tuple("3.0.0.dev0")
        ((2, 60, 0), (2, 61, 0), (3, 0, 0))
    """
    out = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(out)


def in_tested_range(version: str) -> bool:
    """Whether `version` lies in TESTED_RAY_RANGE.

    Example:
        >>> in_tested_range("2.60.0"), in_tested_range("2.52.0"), in_tested_range("2.61.0"), in_tested_range("3.0.0")
        (True, False, False, False)
    """
    low, high = TESTED_RAY_RANGE
    return low <= version_tuple(version) < high


def _shape_problem(module: str, name: str, obj) -> str | None:
    """What is wrong with internal `module.name` (`obj`, None when absent), or None."""
    if obj is None:
        return "missing"
    if name == "ENABLE_RAY_CLUSTER":
        return None if isinstance(obj, bool) else f"not a bool ({type(obj).__name__})"
    if name == "AuthenticationTokenLoader":
        gone = [m for m in ("instance", "reset_cache", "get_token_for_http_header") if not callable(getattr(obj, m, None))]
        return f"has no {', '.join(gone)}" if gone else None
    if name == "global_worker_stdstream_dispatcher":
        if not hasattr(obj, "_lock") or not isinstance(getattr(obj, "handlers", None), list):
            return "has no _lock or no handlers list"
        return None
    if not callable(obj):
        return "not callable"
    return None


def internal_problems() -> list[str]:
    """Each private internal (INTERNALS) that this Ray lacks or has in another shape, as
    'module.name: what (what meshpipe uses it for)'; [] when all are as meshpipe expects."""
    out = []
    for (module, name), use in sorted(INTERNALS.items()):
        why = _shape_problem(module, name, _internal(module, name))
        if why:
            out.append(f"{module}.{name}: {why} ({use})")
    return out


def check_ray_version(embedded: bool = True, version: str | None = None) -> list[str]:
    """Before Ray starts (or is connected to): on a Ray outside TESTED_RAY_RANGE, check the
    internals and warn naming each one that changed. Returns those problems ([] on a tested Ray,
    where `tests/test_ray_internals.py` is the check).

    Raises:
      RayVersionError: `embedded` (meshpipe starts the cluster) and this Ray has lost the
        loopback switch while psutil, which verifies the binding after start, is missing too.
    """
    version = version or _ray_version()
    if in_tested_range(version):
        return []
    problems = internal_problems()
    log.warning("Ray %s is outside the range meshpipe was tested with (%s)%s", version, TESTED_RAY,
                ("; these private internals changed, their features fall back: " + "; ".join(problems))
                if problems else "; every private internal it uses is still there")
    switch = f"{LOOPBACK_SWITCH[0]}.{LOOPBACK_SWITCH[1]}"
    if embedded and any(p.startswith(switch + ":") for p in problems):
        try:
            import psutil  # noqa: F401 - `beyond_loopback` needs it
        except ImportError:
            raise RayVersionError(f"Ray {version} (tested: {TESTED_RAY}) has no usable {switch}, and without "
                                  "psutil the embedded cluster's listening sockets cannot be verified: it might "
                                  "bind routable addresses; refusing to start it (install psutil, or use a "
                                  "tested Ray)") from None
    return problems


@contextlib.contextmanager
def single_machine_mode():
    """While starting an embedded Ray: make it bind and advertise 127.0.0.1 only. Restores
    the environment and the constant afterwards. If the constant is gone, warns (the
    environment variable still applies to the processes Ray spawns, and `beyond_loopback`
    checks the result)."""
    import importlib

    try:
        consts = importlib.import_module("ray._private.ray_constants")
    except ImportError:
        consts = None
    had = consts is not None and hasattr(consts, "ENABLE_RAY_CLUSTER")
    if not had:
        log.warning("Ray %s has no ray._private.ray_constants.ENABLE_RAY_CLUSTER (meshpipe was checked "
                    "against %s); the listening sockets are verified after start", _ray_version(), TESTED_RAY)
    old_env = os.environ.get(SINGLE_MACHINE_VAR)
    old_const = consts.ENABLE_RAY_CLUSTER if had else None
    os.environ[SINGLE_MACHINE_VAR] = "0"
    if had:
        consts.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(SINGLE_MACHINE_VAR, None)
        else:
            os.environ[SINGLE_MACHINE_VAR] = old_env
        if had:
            consts.ENABLE_RAY_CLUSTER = old_const


def auth_headers_from_ray() -> dict | None:
    """Ray's own token header ({"authorization": "Bearer …"} or {}), or None when this Ray's
    loader is missing or behaves differently (the caller then reads the token itself)."""
    loader_cls = _internal("ray._raylet", "AuthenticationTokenLoader")
    if loader_cls is None:
        return None
    try:
        loader = loader_cls.instance()
        loader.reset_cache()   # read the environment as it is now
        return dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    except Exception as e:  # noqa: BLE001 - a private API that changed: fall back, say so at debug level
        log.debug("Ray's AuthenticationTokenLoader failed (%s: %s); reading the token directly", type(e).__name__, e)
        return None


def token_auth_enabled() -> bool:
    """Whether this Ray runs with token authentication; False when it cannot say."""
    fn = _internal("ray._private.authentication.authentication_utils", "is_token_auth_enabled")
    try:
        return bool(fn()) if fn is not None else False
    except Exception:  # noqa: BLE001 - informational (a hint printed at start)
        return False


def wrap_log_printer(wrap) -> bool:
    """Replace Ray's printer of forwarded actor output ("ray_print_logs") by `wrap(printer)`
    (skipped when already wrapped: `printer._meshpipe_filtered`). Returns whether it did;
    False, changing nothing, when this Ray's dispatcher is missing or shaped differently."""
    dispatcher = _internal("ray._private.ray_logging", "global_worker_stdstream_dispatcher")
    if dispatcher is None:
        return False
    try:
        with dispatcher._lock:
            new, wrapped = [], False
            for name, handler in list(dispatcher.handlers):
                if name == "ray_print_logs" and not getattr(handler, "_meshpipe_filtered", False):
                    handler, wrapped = wrap(handler), True
                new.append((name, handler))
            dispatcher.handlers = new
        return wrapped
    except Exception as e:  # noqa: BLE001 - a private API that changed: the output stays unfiltered
        log.debug("Ray's log dispatcher is not as meshpipe expects (%s: %s); actor output unfiltered",
                  type(e).__name__, e)
        return False


def available_resources() -> dict:
    """Node id -> free resources now, or {} when this Ray cannot say."""
    fn = _internal("ray._private.state", "available_resources_per_node")
    try:
        return dict(fn()) if fn is not None else {}
    except Exception:  # noqa: BLE001 - totals stand in for what is free
        return {}


def dashboard_url() -> str | None:
    fn = _internal("ray._private.worker", "get_dashboard_url")
    try:
        return fn() if fn is not None else None
    except Exception:  # noqa: BLE001 - informational
        return None


def current_cluster() -> str | None:
    """The GCS address (host:port) of the cluster `ray start` last started on this machine, as Ray
    records it for `ray.init(address="auto")`; None when there is none (or this Ray keeps it elsewhere)."""
    fn = _internal("ray._private.utils", "read_ray_address")
    try:
        return (fn() or None) if fn is not None else None
    except Exception:  # noqa: BLE001 - an unreadable record is no record
        return None


GCS_DASHBOARD_QUERY = ("import sys\nfrom ray._raylet import GcsClient\n"
                       "url = GcsClient(address=sys.argv[1]).internal_kv_get(b'webui:url', b'dashboard', "
                       "timeout=float(sys.argv[2]))\n"
                       "print((url or b'').decode())\n")


def token_source() -> str | None:
    """Where Ray would read the token from (no value), in Ray's order; None if nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH ({path})"
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def dashboard_of_gcs(gcs_address: str, timeout: float = 20.0) -> tuple[str | None, str]:
    """(the dashboard URL the cluster at `gcs_address` advertises, or None; why not). Asked in a
    subprocess (a GCS client of Ray's own, bounded by `timeout`), with `RAY_AUTH_MODE=token` when
    a token is at hand and the user did not choose a mode: Ray's client needs it to send one."""
    import subprocess
    import sys

    env = dict(os.environ)
    if not env.get("RAY_AUTH_MODE") and token_source():
        env["RAY_AUTH_MODE"] = "token"
    try:
        r = subprocess.run([sys.executable, "-c", GCS_DASHBOARD_QUERY, gcs_address, str(timeout / 2)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout:g} s"
    url = r.stdout.strip().splitlines()[-1].strip() if r.returncode == 0 and r.stdout.strip() else ""
    if not url:
        last = next((ln for ln in reversed(r.stderr.strip().splitlines()) if ln.strip()), f"exit {r.returncode}")
        return None, last[-300:]
    return (url if "://" in url else f"http://{url}"), ""


def bootstrap_address(address: str) -> str | None:
    """The 'host:port' `ray.init(address=address)` dials, or None when Ray would not dial one
    ("auto" with no cluster to find, "local") or this Ray cannot say."""
    if address.startswith("ray://"):
        return address
    fn = _internal("ray._private.services", "canonicalize_bootstrap_address")
    try:
        return fn(address) if fn is not None else address
    except Exception:  # noqa: BLE001 - ray.init reports a malformed address itself
        return None


def compiled_graph_proxy(graph):
    """The helper actor a Ray Compiled Graph started for the driver, or None when this Ray has
    no such attribute (then it lives until the graph object is collected, as Ray intends)."""
    proxy = getattr(graph, "_proxy_actor", None)
    if proxy is None:
        log.debug("this Ray's CompiledDAG has no _proxy_actor; leaving its cleanup to Ray")
    return proxy


def embedded_session() -> tuple[str, int | None] | None:
    """(session directory, raylet pid) of the cluster this process started (`ray.init` without an
    address): `ray._private.worker._global_node`'s `get_session_dir_path()` and its raylet's
    process record; None when this Ray has neither (then no reaper watches the cluster:
    `orchestrator.driver.reaper`)."""
    node = getattr(_internal_module("ray._private.worker"), "_global_node", None)
    try:
        session = node.get_session_dir_path()
        procs = node.all_processes.get("raylet") or []
        raylet = procs[0].process.pid if procs and getattr(procs[0], "process", None) is not None else None
        return str(session), raylet
    except Exception as e:  # noqa: BLE001 - an aid: the next run's sweep still cleans the semaphores
        log.debug("this Ray does not say its session directory or raylet pid: %s", e)
        return None


def _internal_module(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# -- what actually listens -------------------------------------------------------
def listening_sockets(root_pid: int | None = None) -> list[tuple[str, int, int, str]]:
    """(ip, port, pid, process name) of every listening TCP socket of process `root_pid`
    (default: this one) and all its descendants (an embedded Ray's GCS, raylet, agents,
    dashboard and workers are)."""
    import psutil

    root = psutil.Process(root_pid or os.getpid())
    procs = {root.pid: root}
    for child in root.children(recursive=True):
        procs[child.pid] = child
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, c.pid, name))
    return sorted(set(out))


def _is_loopback(ip: str) -> bool:
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def beyond_loopback(allowed: set[str] = frozenset(), root_pid: int | None = None) -> list[str]:
    """Listening sockets of this process tree bound beyond loopback, except on `allowed` IPs
    (what the cluster YAML asked for, e.g. `dashboard_host`), as 'ip:port (process pid)'."""
    return [f"{ip}:{port} ({name} {pid})" for ip, port, pid, name in listening_sockets(root_pid)
            if not _is_loopback(ip) and ip not in allowed]
