"""IR: action text form, schedule JSON form, virtual-stage helpers."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.core.schedule import Action, Kind, Schedule, ScheduleError, generate, lower
from orchestrator.core.schedule.ir import comm_peer, edge_index, next_virtual, prev_virtual

actions = st.one_of(
    st.builds(Action, st.integers(0, 99), st.sampled_from([k for k in Kind if k is not Kind.OPT]),
              st.integers(0, 999), st.integers(0, 9)),
    st.builds(Action, st.integers(0, 99), st.just(Kind.OPT), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(actions)
def test_text_form_round_trips(a):
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text, expected", [
    ("1F0", Action(1, Kind.F, 0)),
    ("0B3", Action(0, Kind.B, 3)),
    ("2SEND_F1", Action(2, Kind.SEND_F, 1)),
    ("1F3c1", Action(1, Kind.F, 3, 1)),
    ("0OPT", Action(0, Kind.OPT, None)),
    ("12RECV_B10c3", Action(12, Kind.RECV_B, 10, 3)),
])
def test_known_text_forms(text, expected):
    assert Action.parse(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize("text", ["F0", "0X1", "0OPT1", "0F", "0OPTc1", "0F1c", "-1F0", "0 F0", ""])
def test_parse_rejects_malformed(text):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_action_rejects_inconsistent_fields():
    with pytest.raises(ScheduleError, match="microbatch"):
        Action(0, Kind.F, None)
    with pytest.raises(ScheduleError, match="OPT takes no microbatch"):
        Action(0, Kind.OPT, 1)
    with pytest.raises(ScheduleError, match="stage"):
        Action(-1, Kind.F, 0)
    assert Action(0, "W", 1).kind is Kind.W       # kinds given as strings are coerced


def test_action_is_immutable_and_hashable():
    a = Action(0, Kind.F, 0)
    with pytest.raises(AttributeError):
        a.stage = 1
    assert len({a, Action(0, Kind.F, 0)}) == 1


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                           ("zb-h1", 3, 5, 1)])
def test_json_round_trips(name, p, m, v):
    for sched in (generate(name, p, m, v), lower(generate(name, p, m, v))):
        data = json.loads(json.dumps(sched.to_json()))
        assert set(data) == {"name", "p", "m", "v", "lowered", "grid"}
        assert Schedule.from_json(data) == sched


def test_schedule_normalises_rows_and_checks_their_number():
    f = Action(0, Kind.F, 0)
    s = Schedule("x", 1, 1, 1, [[f, None, None]])
    assert s.actions == ((f,),)
    assert s.grid() == [["0F0"]]
    with pytest.raises(ScheduleError, match="2 action rows but stages=1"):
        Schedule("x", 1, 1, 1, ((f,), ()))


def test_virtual_stage_neighbours():
    # p=3, v=2: virtual 0..5 is (s0c0, s1c0, s2c0, s0c1, s1c1, s2c1)
    assert next_virtual(2, 0, 3, 2) == (0, 1)
    assert prev_virtual(0, 1, 3) == (2, 0)
    assert prev_virtual(0, 0, 3) is None and next_virtual(2, 1, 3, 2) is None
    assert str(comm_peer(Action.parse("2SEND_F4"), 3, 2)) == "0RECV_F4c1"
    assert str(comm_peer(Action.parse("0SEND_B4c1"), 3, 2)) == "2RECV_B4"
    assert comm_peer(Action.parse("0RECV_F0"), 3, 1) is None            # pipeline start
    assert edge_index(Action.parse("2SEND_F4"), 3) == 2                  # wrap-around link
    assert edge_index(Action.parse("0RECV_F4c1"), 3) == 2
    assert edge_index(Action.parse("1SEND_B0"), 3) == 0
