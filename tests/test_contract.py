"""The driver -> actor contract (`orchestrator.core.contract`) stays typed: every field of every
value that crosses the Ray boundary is frozen and has a concrete type, no `dict`, `Mapping` or
`Any` (the one exception: an optax entry's keyword arguments, which are the user's own), so a new
field is readable in the one file and checked where it is built. Pure: no Ray, no JAX.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import pickle
import typing

import pytest

from orchestrator.core import contract

# (class, field) whose value is free-form by nature: optax's keyword arguments, numbers or schedules
FREE_FORM = {("OptimizerEntry", "args")}
UNTYPED = (dict, list, typing.Any, collections.abc.Mapping)


def _untyped(hint) -> bool:
    """Whether a type hint is, or holds, dict / list / Mapping / Any (`Optional[Mapping[...]]` too)."""
    if hint is typing.Any or typing.get_origin(hint) in UNTYPED or hint in UNTYPED:
        return True
    return any(_untyped(a) for a in typing.get_args(hint) if a is not Ellipsis)


def untyped_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f"{cls.__name__}.{f.name}: {hints[f.name]}" for f in dataclasses.fields(cls)
            if (cls.__name__, f.name) not in FREE_FORM and _untyped(hints[f.name])]


VALUES = [getattr(contract, n) for n in contract.__all__
          if dataclasses.is_dataclass(getattr(contract, n)) and isinstance(getattr(contract, n), type)]


def test_the_contract_has_its_values():
    names = {c.__name__ for c in VALUES}
    assert {"WorkerConfig", "StageSpec", "TransportSpec", "CheckpointSpec", "RestorePlan", "Timeouts",
            "OptimizerSpec", "StepFailure"} <= names


@pytest.mark.parametrize("cls", VALUES, ids=lambda c: c.__name__)
def test_every_contract_value_is_frozen_and_typed(cls):
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    assert untyped_fields(cls) == []


def test_the_check_finds_an_untyped_field():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        plan: dict
        extra: typing.Optional[typing.Mapping[str, int]] = None
        rows: tuple[typing.Any, ...] = ()
        ok: tuple[tuple[str, int], ...] = ()

    assert [f.split(":")[0] for f in untyped_fields(Loose)] == ["Loose.plan", "Loose.extra", "Loose.rows"]


def test_a_failure_and_an_actor_survive_pickling_with_their_fields():
    f = contract.StepFailure(1, 0, 7, "ValueError: boom", kind="storage", errno=28, path="/ck/step_00000004")
    back = pickle.loads(pickle.dumps(f))
    assert back == f and back.actor.stage == 1 and back.actor.host == 0
    a = pickle.loads(pickle.dumps(contract.ActorId(2, 3)))
    assert (str(a), a.stage, a.host) == ("stage 2 host 3", 2, 3)
