"""Moving tensors between stages: the transport interface and its implementations.

A transport turns a stage's output `jax.Array` into pushes to the next stage's
actors and, on the receiving side, mailbox payloads back into a `jax.Array` with
the receiver's sharding. The schedule decides *when*; the transport only *how*.

`DirectTransport` (simple, correct): the sender gathers the array to host memory
and pushes it whole to every receiving host; each receiver builds its own shards
from it. Only valid when the sending stage is a single host.
"""
from __future__ import annotations

import numpy as np


class Transport:
    """What the stage worker needs from a transport."""

    def __init__(self, worker):
        self.worker = worker
        self._inflight: list = []

    def from_host(self, arr: np.ndarray, sharding):
        """A host-side global array (same on every host of the stage) as a sharded jax.Array."""
        import jax

        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    def send(self, key, array, peers: list) -> None:
        raise NotImplementedError

    def recv(self, key, sharding, timeout: float):
        raise NotImplementedError

    def flush(self, timeout: float) -> None:
        """Wait (bounded) for this step's pushes to be accepted; surfaces a dead receiver."""
        import ray

        if self._inflight:
            ray.get(self._inflight, timeout=timeout)
        self._inflight.clear()

    def push(self, peer, key, payload) -> None:
        self._inflight.append(peer.deliver.options(concurrency_group="io").remote(key, payload))


class DirectTransport(Transport):
    def send(self, key, array, peers):
        host = np.asarray(array)
        for peer in peers:
            self.push(peer, key, host)

    def recv(self, key, sharding, timeout):
        return self.from_host(self.worker.inbox.take(key, timeout), sharding)


def make_transport(worker) -> Transport:
    return DirectTransport(worker)
