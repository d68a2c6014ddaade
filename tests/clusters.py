"""The simulated multi-node Ray cluster of the `multinode` tests, bound to loopback only.

`ray.cluster_utils.Cluster` starts every node's GCS, raylet, object manager, agents and
workers on the machine's routable address unless told otherwise, so test traffic would leave
the loopback range. Passing `node_ip_address="127.0.0.1"` to each node is not enough on its
own: `ray.init(address="127.0.0.1:<port>")` then rewrites the loopback address back into the
routable one (`ray._private.services.resolve_ip_for_localhost`, while Ray's cluster mode is
on) and its GcsClient waits forever on a port nothing listens on. Ray's single-machine mode
(`orchestrator.driver.ray_internals.single_machine_mode`, the same switch meshpipe's embedded
cluster uses) turns that rewrite off; it is held while the nodes start (the processes they
spawn inherit it) and while this process connects.

`simulated_cluster(...)` yields the `Cluster` connected to this process, after checking that
no process of its tree listens beyond loopback; `LoopbackWatch` repeats that check in the
background during a run (stage actors, their transport listeners and the jax.distributed
coordinators start only then).

    with simulated_cluster("ns", head={"num_cpus": 1}, nodes=[{"num_cpus": 2}] * 3) as c:
        with LoopbackWatch() as watch:
            run_job(...)
        assert watch.seen ...
"""
from __future__ import annotations

import contextlib
import os
import threading

import pytest

LOOPBACK = "127.0.0.1"


def exposed() -> list[str]:
    """Listening sockets of this process and its descendants (every Ray process a `Cluster`
    started, the workers included) bound beyond loopback, as 'ip:port (process pid)'."""
    from orchestrator.driver.ray_internals import beyond_loopback

    return beyond_loopback(root_pid=os.getpid())


def assert_loopback_only(when: str) -> None:
    bad = exposed()
    if bad:
        raise AssertionError(f"{when}: the simulated cluster listens beyond loopback: {', '.join(bad)}")


@contextlib.contextmanager
def simulated_cluster(namespace: str, head: dict, nodes: list[dict], wait_timeout: float = 120,
                      **init_args):
    """A head (`head`: Cluster.add_node arguments) and one node per entry of `nodes`, all on
    127.0.0.1, this process connected with `namespace`; shut down on exit.

    Nodes start in parallel (`wait=False`), then `wait_for_nodes`. Fails the test when Ray is
    already initialised in this process (the multinode tests need a pytest process of their own).
    """
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.driver.ray_internals import single_machine_mode

    if ray.is_initialized():
        pytest.fail("the multinode tests need a pytest process of their own: run `pytest -m multinode`")
    with single_machine_mode():
        c = Cluster(initialize_head=True, head_node_args={**head, "node_ip_address": LOOPBACK})
        try:
            for args in nodes:
                c.add_node(wait=False, **{**args, "node_ip_address": LOOPBACK})
            ray.init(address=c.address, namespace=namespace, _node_ip_address=LOOPBACK, **init_args)
        except BaseException:
            c.shutdown()
            raise
    try:
        c.wait_for_nodes(timeout=wait_timeout)
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 1 + len(nodes), alive
        assert {n["NodeManagerAddress"] for n in alive} == {LOOPBACK}, [n["NodeManagerAddress"] for n in alive]
        assert_loopback_only("after start")
        yield c
        assert_loopback_only("at the end of the module")
    finally:
        ray.shutdown()
        c.shutdown()


class LoopbackWatch:
    """While open, lists this process tree's listening sockets every `every` seconds (a run's
    stage actors, their TCP transport listeners and jax.distributed coordinators included);
    `seen` is every listening ip:port observed, `bad` those beyond loopback."""

    def __init__(self, every: float = 0.2):
        self.every = every
        self.seen: set[tuple[str, int]] = set()
        self.bad: set[str] = set()
        self.samples = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from orchestrator.driver.ray_internals import _is_loopback, listening_sockets

        while not self._stop.is_set():
            try:
                for ip, port, pid, name in listening_sockets(os.getpid()):
                    self.seen.add((ip, port))
                    if not _is_loopback(ip):
                        self.bad.add(f"{ip}:{port} ({name} {pid})")
                self.samples += 1
            except Exception as e:  # noqa: BLE001 - a process that exits mid-listing; report the last one
                self.error = e
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
