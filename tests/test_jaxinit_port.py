"""The jax.distributed coordinator port: reserved without a race, checked after binding.

`stages.jaxinit.reserve_port` holds the port (SO_REUSEPORT, bound, not listening) until
jax's coordinator has bound it; another process cannot take it meanwhile (another uid not
even with SO_REUSEPORT), the installed jax still binds beside the reservation, and
`coordinator_is_ours` tells this process's listener from another process's.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from stages.jaxinit import coordinator_is_ours, reserve_port
from tests.conftest import ROOT

NOBODY = 65534


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _bind_errno(port: int, reuse: bool) -> int:
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno
        return 0


def test_a_reserved_port_cannot_be_taken_by_another_socket():
    address, held = reserve_port("127.0.0.1")
    try:
        assert address.startswith("127.0.0.1:") and held.getsockname()[1] == _port(address)
        assert _bind_errno(_port(address), reuse=False) == errno.EADDRINUSE
    finally:
        held.close()
    assert _bind_errno(_port(address), reuse=False) == 0      # released: free again


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to try the bind as another uid")
def test_another_uid_cannot_share_the_reserved_port_even_with_so_reuseport():
    """The attack bind-then-close allowed: another local user binding the port first. With the
    reservation held, its bind fails even with SO_REUSEPORT (Linux: same effective uid only)."""
    address, held = reserve_port("127.0.0.1")
    try:
        pid = os.fork()      # a child that only binds, as `nobody` (no exec: no interpreter to reach)
        if pid == 0:
            code = 1
            try:
                os.setuid(NOBODY)
                code = _bind_errno(_port(address), reuse=True)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == errno.EADDRINUSE, os.WEXITSTATUS(status)
    finally:
        held.close()


JOIN = r"""
import json, os, sys
from orchestrator.core.backends.jaxinit import ENV_KEY, JaxInit
from stages.jaxinit import coordinator_is_ours, initialize, reserve_port

os.environ[ENV_KEY] = JaxInit("explicit", 1, 0).to_env()
address, held = reserve_port("127.0.0.1")
initialize(1, 0, address, 20, who="test", reservation=held)
import jax
print(json.dumps({"ours": coordinator_is_ours(address), "released": held.fileno() == -1,
                  "processes": jax.process_count()}))
jax.distributed.shutdown()
"""


def test_jax_coordinator_binds_beside_the_reservation_and_is_ours():
    """Fails loudly if a jax release stops binding its coordinator with SO_REUSEPORT (the
    reservation would then make every multi-host stage fail to start)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", JOIN], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ours": True, "released": True, "processes": 1}


def test_coordinator_is_ours_tells_this_process_from_another():
    with socket.create_server(("127.0.0.1", 0)) as mine:
        assert coordinator_is_ours(f"127.0.0.1:{mine.getsockname()[1]}")
    other = subprocess.Popen([sys.executable, "-c", "import socket, sys\ns = socket.create_server(('127.0.0.1', 0))\n"
                              "print(s.getsockname()[1], flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(other.stdout.readline())
        assert not coordinator_is_ours(f"127.0.0.1:{port}")              # someone else's listener
        assert coordinator_is_ours(f"127.0.0.1:{port}", pid=other.pid)
        assert not coordinator_is_ours(f"[::1]:{port}")
    finally:
        other.stdin.close()
        other.wait(timeout=30)
