"""Shared fixtures: one embedded local Ray per test session, and leak checks.

Ray is started once (starting it costs seconds) with more logical CPUs than the
machine has cores: stage actors reserve fractional CPUs and mostly wait on each
other. Tests that use it check that they leave no actor or placement group.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_compile_cache() -> None:
    """One JAX persistent compilation cache for this pytest session, shared by every process it
    starts (the driver, the Ray workers and nodes, which inherit this environment): the suites
    compile the same small stage programs in test after test, and compiling was a third of a
    pipeline test's time on a slow day. A fresh owner-only directory per session, removed at its
    end, so no run reads another's entries; a process that sets its own cache (the product's
    `failure.compile_cache`) still does."""
    import atexit
    import shutil
    import tempfile

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="meshpipe-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, path, True)


_session_compile_cache()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from orchestrator.driver.placement import loopback_only

    if not ray.is_initialized():
        # the dashboard serves the state API the leak checks use; loopback only, any free port
        with loopback_only():
            ray.init(address="local", num_cpus=8, include_dashboard=True, dashboard_host="127.0.0.1",
                     dashboard_port=free_port(), namespace="meshpipe-tests", logging_level="WARNING")
    yield ray
    ray.shutdown()


def _address() -> str:
    """The connected cluster's address: other Ray instances may run on this machine too."""
    import ray

    return ray.get_runtime_context().gcs_address


def alive_actors() -> list:
    from ray.util.state import list_actors

    return list_actors(address=_address(), filters=[("state", "=", "ALIVE")])


def live_placement_groups() -> list:
    from ray.util.state import list_placement_groups

    return [pg for pg in list_placement_groups(address=_address()) if pg.state != "REMOVED"]


def wait_until(cond, timeout: float = 30.0, what: str = "condition", every: float = 0.05):
    """Poll `cond` until it returns truthy or the deadline passes (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


@pytest.fixture
def no_leaks(ray_local):
    """Asserts the test leaves no live actor or placement group behind."""
    yield
    wait_until(lambda: not alive_actors(), 30, "all actors to exit")
    wait_until(lambda: not live_placement_groups(), 30, "all placement groups to be removed")


QUICK_SKIPS = ("ray", "multinode", "flood", "slow", "gpu", "tpu")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="only the tests that start no Ray (deselects markers: " + ", ".join(QUICK_SKIPS) + ")")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in QUICK_SKIPS) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
