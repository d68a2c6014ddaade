"""Ray's private internals meshpipe relies on (`orchestrator.driver.ray_internals`).

These tests fail loudly, naming the internal, when a Ray upgrade renames or changes one,
so the upgrade is noticed here rather than as a silently exposed cluster. The loopback
verification itself is tested on real sockets.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from orchestrator.driver import ray_internals


@pytest.mark.parametrize("module,name", sorted(ray_internals.INTERNALS))
def test_every_private_internal_still_exists(module, name):
    import ray

    mod = importlib.import_module(module)
    assert hasattr(mod, name), (f"Ray {ray.__version__} has no {module}.{name} "
                                f"({ray_internals.INTERNALS[(module, name)]}); meshpipe was checked against "
                                f"Ray {ray_internals.TESTED_RAY}: re-check orchestrator/driver/ray_internals.py")


@pytest.mark.ray_260
def test_the_internals_keep_their_shape():
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader

    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    for method in ("instance", "reset_cache", "get_token_for_http_header"):
        assert callable(getattr(AuthenticationTokenLoader, method, None)), method
    headers = ray_internals.auth_headers_from_ray()
    assert isinstance(headers, dict), "AuthenticationTokenLoader no longer answers as meshpipe expects"
    # an instance attribute, set in the constructor (test_cli's compiled-graph leak check is the live test)
    from ray.dag.compiled_dag_node import CompiledDAG
    assert "self._proxy_actor =" in inspect.getsource(CompiledDAG.__init__), "CompiledDAG._proxy_actor is gone"
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    assert isinstance(is_token_auth_enabled(), bool) and isinstance(ray_internals.token_auth_enabled(), bool)
    assert isinstance(dispatcher.handlers, list) and hasattr(dispatcher._lock, "__enter__")
    assert ray_internals.internal_problems() == []


def test_the_tested_range_is_pyprojects_pins_and_holds_the_installed_ray():
    import ray

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    low, high = re.search(r'"ray\[default\]>=([0-9.]+),<([0-9.]+)"', text).groups()
    assert ray_internals.TESTED_RAY_RANGE == (ray_internals.version_tuple(low), ray_internals.version_tuple(high))
    assert ray_internals.in_tested_range(ray.__version__), ray.__version__


def test_the_version_guard_is_silent_on_a_tested_ray(caplog):
    import ray

    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        assert ray_internals.check_ray_version(version=ray.__version__) == []
        assert ray_internals.check_ray_version(version="2.52.1") == []
    assert not caplog.text


def test_the_version_guard_warns_on_an_untested_ray_naming_what_changed(monkeypatch, caplog):
    from ray._private import ray_logging

    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        assert ray_internals.check_ray_version(version="2.99.0") == []
    assert "Ray 2.99.0 is outside the range" in caplog.text and "still there" in caplog.text
    caplog.clear()
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", object())
    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        got = ray_internals.check_ray_version(version="3.0.0")
    assert got == ["ray._private.ray_logging.global_worker_stdstream_dispatcher: has no _lock or no handlers list "
                   f"({ray_internals.INTERNALS[('ray._private.ray_logging', 'global_worker_stdstream_dispatcher')]})"]
    assert "Ray 3.0.0 is outside" in caplog.text and "global_worker_stdstream_dispatcher" in caplog.text


def test_the_version_guard_refuses_an_embedded_cluster_it_can_neither_bind_nor_verify(monkeypatch, caplog):
    from ray._private import ray_constants

    monkeypatch.delattr(ray_constants, "ENABLE_RAY_CLUSTER")
    with caplog.at_level(logging.WARNING, logger="meshpipe"):    # psutil verifies after start: a warning
        assert any("ENABLE_RAY_CLUSTER: missing" in p for p in ray_internals.check_ray_version(version="3.0.0"))
    monkeypatch.setitem(sys.modules, "psutil", None)             # and nothing could verify it
    with pytest.raises(ray_internals.RayVersionError, match="ENABLE_RAY_CLUSTER.*refusing"):
        ray_internals.check_ray_version(version="3.0.0")
    ray_internals.check_ray_version(embedded=False, version="3.0.0")   # a cluster someone else started
    assert ray_internals.check_ray_version(version="2.60.0") == []     # a tested Ray: the test suite checks


def test_changed_log_dispatcher_and_auth_check_fall_back_quietly(monkeypatch):
    from ray._private import ray_logging
    from ray._private.authentication import authentication_utils

    from orchestrator.driver import quiet

    monkeypatch.setenv("MESHPIPE_QUIET", "1")
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", object())   # no _lock, no handlers
    assert quiet.filter_worker_logs() is False
    monkeypatch.delattr(ray_logging, "global_worker_stdstream_dispatcher")
    assert quiet.filter_worker_logs() is False

    def broken():
        raise TypeError("is_token_auth_enabled() takes 1 positional argument")
    monkeypatch.setattr(authentication_utils, "is_token_auth_enabled", broken)
    assert ray_internals.token_auth_enabled() is False


def test_single_machine_mode_sets_and_restores_the_switch(monkeypatch):
    from ray._private import ray_constants

    monkeypatch.delenv(ray_internals.SINGLE_MACHINE_VAR, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_internals.single_machine_mode():
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        assert os.environ[ray_internals.SINGLE_MACHINE_VAR] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert ray_internals.SINGLE_MACHINE_VAR not in os.environ


def test_single_machine_mode_warns_when_the_constant_is_gone(monkeypatch, caplog):
    from ray._private import ray_constants

    monkeypatch.delattr(ray_constants, "ENABLE_RAY_CLUSTER")
    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        with ray_internals.single_machine_mode():
            pass
    assert "has no ray._private.ray_constants.ENABLE_RAY_CLUSTER" in caplog.text


def test_beyond_loopback_finds_a_socket_on_all_interfaces():
    """A real listening socket of this process on 0.0.0.0 is reported (and allowed only by name);
    one on 127.0.0.1 is not."""
    with socket.create_server(("0.0.0.0", 0)) as wide, socket.create_server(("127.0.0.1", 0)) as local:
        port, lport = wide.getsockname()[1], local.getsockname()[1]
        found = ray_internals.beyond_loopback()
        assert any(f"0.0.0.0:{port} " in f for f in found), found
        assert not any(f":{lport} " in f for f in found)
        assert not any(f"0.0.0.0:{port} " in f for f in ray_internals.beyond_loopback({"0.0.0.0"}))


def test_verify_loopback_refuses_an_exposed_embedded_cluster():
    from orchestrator.core.backends import PlacementError
    from orchestrator.core.config import parse_cluster
    from orchestrator.driver.placement import verify_loopback

    cluster = parse_cluster({"hosts": 1, "devices_per_host": 1})
    with socket.create_server(("0.0.0.0", 0)) as wide:
        with pytest.raises(PlacementError, match=f"0.0.0.0:{wide.getsockname()[1]}"):
            verify_loopback(cluster)
    verify_loopback(cluster)    # nothing exposed now: no error
