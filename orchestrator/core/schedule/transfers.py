"""The order in which every process of one JAX world issues a step's stage-to-stage transfers.

Why an order at all: in one `jax.distributed` world (cluster `transport: xla`) a cross-process
`jax.device_put` is matched between sender and receiver by a transfer key that each process
draws from its OWN counter, one or more per call — and XLA draws them in every process that
makes the call, taking part or not (XLA's `pjrt_client.cc` under xla/python/pjrt_ifrt, the DCN fallback in
`transfer_server.cc`: "the transfer key must be incremented in all processes"). Two processes
agree on a key only if they drew the same number before it. So every process of the world makes
every transfer call of a step, in one order: the processes an edge involves move data, every
other process makes the same call on placeholders and only draws the keys (no I/O, no wait).
Measured on jax 0.10.2 (CPU, 3 processes): with only the two processes of each transfer calling,
the first transfer between a pair arrived and every later one that followed a transfer the pair
did not share never did; with every process calling, all arrived with the right values.

The order must also never make a process wait for itself: its transfer thread issues the step's
transfers one after another, blocking on a SEND until its compute thread has produced the
tensor. A SEND that comes after a RECV in a stage's list needs that RECV's data first, so every
such RECV must precede it in the order. `lower` puts each SEND in an earlier column of the grid
than its RECV and every RECV before the compute that consumes it, so ordering the SENDs by
their column (then stage) satisfies that; `world_order` checks it anyway and names the pair
that breaks it.

`Transfer` names one edge crossing of one microbatch: direction ("F" activations to the next
virtual stage, "B" gradients to the previous), microbatch, the two (stage, chunk) ends and the
layer boundary it crosses (the activation leaving layer `boundary - 1`), from which any process
knows the leaves, shapes and dtypes without asking the two stages. Pure: no jax, no ray.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.core.schedule.ir import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    comm_peer,
)

__all__ = ["Transfer", "world_order"]


@dataclass(frozen=True)
class Transfer:
    """One tensor crossing between two stages in one step (all its leaves; see the module docstring).

    Example:
        >>> t = Transfer("F", 2, 0, 0, 1, 0, 4)
        >>> t.key(7, "F"), str(t)
        ((7, 'F', 2, 0), 'F2 0c0->1c0 @4')
    """

    kind: str           # "F" (activation, forward) or "B" (gradient, backward)
    microbatch: int
    src: int            # sending stage and its chunk
    src_chunk: int
    dst: int            # receiving stage and its chunk
    dst_chunk: int
    boundary: int       # the activation leaving layer boundary - 1 (its gradient, for "B")

    def key(self, step: int, tag: str) -> tuple:
        """The mailbox key the stage worker uses for it, without the leaf index: (step, tag, microbatch,
        receiving chunk); `tag` is the forward's ("F", "E<batch>"); gradients are always "B"."""
        return (step, tag if self.kind == "F" else "B", self.microbatch, self.dst_chunk)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch} {self.src}c{self.src_chunk}->{self.dst}c{self.dst_chunk} @{self.boundary}"


def world_order(lowered: Schedule, chunks: Sequence[Sequence[tuple[int, int]]]) -> tuple[Transfer, ...]:
    """Every transfer of one step of `lowered`, in the order every process of the world issues them.

    Args:
      lowered: a lowered schedule (training, or the forward-only eval).
      chunks: per stage, the (start, stop) layer range of each of its chunks.

    Raises:
      ScheduleError: a SEND that the order would issue before a RECV its own stage runs earlier
        (only a hand-made grid can do that; `lower`'s cannot).

    Example:
        >>> from orchestrator.core.schedule import generate, lower
        >>> order = world_order(lower(generate("1f1b", 2, 2)), [[(0, 2)], [(2, 4)]])
        >>> [str(t) for t in order]
        ['F0 0c0->1c0 @2', 'F1 0c0->1c0 @2', 'B0 1c0->0c0 @2', 'B1 1c0->0c0 @2']
    """
    if not lowered.lowered:
        raise ScheduleError(f"world_order: schedule {lowered.name!r} is not lowered")
    p, v = lowered.p, lowered.v
    sends = sorted(((t, s, a) for s, t, a in lowered.cells() if a.kind in (Kind.SEND_F, Kind.SEND_B)),
                   key=lambda x: (x[0], x[1]))
    position = {}
    order = []
    for i, (_, s, a) in enumerate(sends):
        peer = comm_peer(a, p, v)
        if peer is None:
            raise ScheduleError(f"world_order: {a} has no receiving stage")
        position[peer] = i          # the RECV is issued with its SEND
        order.append(_transfer(a, peer, chunks))
    for s, row in enumerate(lowered.actions):
        received = -1
        for a in row:
            if a is None:
                continue
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                received = max(received, position[a])
            elif a.kind in (Kind.SEND_F, Kind.SEND_B) and position[comm_peer(a, p, v)] < received:
                raise ScheduleError(f"world_order: stage {s} sends {a} after receiving a tensor the order "
                                    f"issues later ({order[received]}); its transfer thread would wait for itself")
    return tuple(order)


def _transfer(send: Action, recv: Action, chunks) -> Transfer:
    start, stop = chunks[send.stage][send.chunk]
    forward = send.kind is Kind.SEND_F
    return Transfer("F" if forward else "B", send.microbatch, send.stage, send.chunk, recv.stage, recv.chunk,
                    stop if forward else start)
