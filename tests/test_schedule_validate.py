"""Validator: each rule fires on a hand-broken schedule, naming the rule and marking the cell."""
from dataclasses import replace

import pytest

from orchestrator.core.schedule import Action, Schedule, ScheduleError, generate, lower, validate


def edit(sched, stage, fn):
    """Copy of `sched` with stage's row replaced by fn(list of actions)."""
    rows = [list(r) for r in sched.actions]
    rows[stage] = fn(rows[stage])
    return replace(sched, actions=rows)


def swap(sched, stage, x, y):
    def fn(row):
        i, j = row.index(Action.parse(x)), row.index(Action.parse(y))
        row[i], row[j] = row[j], row[i]
        return row
    return edit(sched, stage, fn)


def drop(sched, stage, x):
    return edit(sched, stage, lambda row: [None if a == Action.parse(x) else a for a in row])


def rejects(sched, rule, marked):
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    msg = str(err.value)
    assert err.value.rule == rule
    assert f"rule {rule!r} broken" in msg
    assert f"[{marked}]" in msg, msg                   # the faulty cell is marked ...
    assert f"{sched.name} p={sched.p} m={sched.m}" in msg  # ... in the whole grid
    for s in range(sched.p):
        assert f"\ns{s} " in msg
    return msg


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 3, 3, 1), ("1f1b", 4, 8, 1),
                                           ("eager-1f1b", 4, 3, 1), ("interleaved-1f1b", 2, 4, 2),
                                           ("zb-h1", 4, 8, 1), ("interleaved-1f1b", 1, 1, 4)])
def test_generated_and_lowered_schedules_validate(name, p, m, v):
    validate(generate(name, p, m, v))
    validate(lower(generate(name, p, m, v)))


def test_f_before_b():
    rejects(swap(generate("1f1b", 2, 2), 1, "1F0", "1B0"), "F-before-B", "1B0")
    rejects(swap(lower(generate("1f1b", 2, 2)), 1, "1F0", "1B0"), "F-before-B", "1B0")


def test_i_before_w():
    rejects(swap(generate("zb-h1", 2, 2), 0, "0I1", "0W1"), "I-before-W", "0W1")


def test_dependency_on_the_previous_stage():
    # stage 0 runs F1 before F0, so stage 1's F0 (slot 1) comes before 0F0 (now slot 1)
    rejects(swap(generate("gpipe", 2, 2), 0, "0F0", "0F1"), "dependency", "1F0")


def test_dependency_on_the_next_stage_for_backwards():
    rejects(swap(generate("1f1b", 3, 3), 2, "2B0", "2F1"), "dependency", "1B0")


def test_complete_and_exactly_once():
    sched = generate("1f1b", 2, 3)
    rejects(drop(sched, 0, "0B2"), "complete", "0F2")
    dup = edit(sched, 1, lambda row: row + [Action.parse("1F0")])
    rejects(dup, "exactly-once", "1F0")


def test_b_or_i_and_w():
    split = [Action.parse("0I0"), Action.parse("0W0")]
    sched = edit(generate("1f1b", 1, 1), 0, lambda row: row + split)
    rejects(sched, "B-or-IW", "0B0")


def test_stage_row_and_index_range():
    sched = generate("1f1b", 2, 2)
    rejects(edit(sched, 0, lambda row: row + [Action.parse("1F5")]), "stage-row", "1F5")
    rejects(edit(sched, 0, lambda row: row + [Action.parse("0F5")]), "index-range", "0F5")
    rejects(edit(sched, 0, lambda row: row + [Action.parse("0F0c1")]), "index-range", "0F0c1")


def test_comm_actions_only_in_lowered_schedules():
    low = lower(generate("1f1b", 2, 2))
    rejects(replace(low, lowered=False), "comm-in-compute", "0SEND_F0")


def test_opt_after_all_backwards():
    low = lower(generate("1f1b", 2, 2))
    rejects(swap(low, 0, "0OPT", "0B1"), "OPT-last", "0OPT")


def test_dropped_receive():
    low = lower(generate("1f1b", 2, 2))
    msg = rejects(drop(low, 1, "1RECV_F1"), "sends-match-receives", "0SEND_F1")
    assert "no matching 1RECV_F1" in msg and "[1F1]" in msg    # the consumer is marked too


def test_dropped_send_and_receive_pair():
    low = drop(drop(lower(generate("1f1b", 2, 2)), 1, "1RECV_F1"), 0, "0SEND_F1")
    rejects(low, "sends-match-receives", "1F1")


def test_comm_where_nothing_crosses():
    low = edit(lower(generate("1f1b", 2, 2)), 0, lambda row: [Action.parse("0RECV_F0")] + row)
    rejects(low, "sends-match-receives", "0RECV_F0")


def test_send_before_its_producer():
    low = lower(generate("1f1b", 2, 2))
    rejects(swap(low, 0, "0F1", "0SEND_F1"), "send-after-produce", "0SEND_F1")


def test_recv_after_its_consumer():
    rejects(swap(lower(generate("1f1b", 2, 2)), 1, "1F1", "1RECV_F1"), "recv-before-consume", "1F1")


def test_deadlock_names_the_stuck_actions():
    a = Action.parse
    sched = Schedule("crossed", 2, 1, 1, (
        (a("0F0"), a("0RECV_B0"), a("0SEND_F0"), a("0B0"), a("0OPT")),
        (a("1RECV_F0"), a("1F0"), a("1B0"), a("1SEND_B0"), a("1OPT")),
    ), lowered=True)
    msg = rejects(sched, "no-deadlock", "0RECV_B0")
    assert "[1RECV_F0]" in msg
    assert "stage 0 at 0RECV_B0 waits for 1SEND_B0" in msg
    assert "stage 1 at 1RECV_F0 waits for 0SEND_F0" in msg
