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
import socket

import pytest

from orchestrator.driver import ray_internals


@pytest.mark.parametrize("module,name", sorted(ray_internals.INTERNALS))
def test_every_private_internal_still_exists(module, name):
    import ray

    mod = importlib.import_module(module)
    assert hasattr(mod, name), (f"Ray {ray.__version__} has no {module}.{name} "
                                f"({ray_internals.INTERNALS[(module, name)]}); meshpipe was checked against "
                                f"Ray {ray_internals.TESTED_RAY}: re-check orchestrator/driver/ray_internals.py")


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
