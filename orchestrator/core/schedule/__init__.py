"""Pipeline schedules as data: IR, generators, lowering, validation, simulation, pictures.

Basic flow::

    sched = generate("1f1b", p=4, m=8)        # compute-only, slots are time steps
    validate(sched)
    low = lower(sched)                        # + matched SEND/RECV pairs, + OPT per stage
    validate(low)
    sim = simulate(low, {"F": 1.0, "B": 2.0}, transfer=0.1)
    kept = stash_timeline(low, {"F": res_bytes, "I": held_bytes})    # bytes kept, action by action
    print(render_grid(low)); render_png(sim, low, "1f1b.png")

A runtime executes ``low.actions[s]`` in order on stage s (skipping None):
RECV blocks until its matching SEND ran; SEND never blocks. Pure: imports
neither ray nor jax (matplotlib only inside `render_png`).
"""
from orchestrator.core.schedule.generators import SCHEDULES, check_params, forward_only, generate
from orchestrator.core.schedule.ir import Action, Kind, Schedule, ScheduleError
from orchestrator.core.schedule.lowering import add_comms, add_optimizer_step, lower
from orchestrator.core.schedule.render import render_grid, render_png, to_chrome_trace
from orchestrator.core.schedule.simulate import SimResult, simulate
from orchestrator.core.schedule.stash import StashResult, stash_timeline
from orchestrator.core.schedule.validate import validate

__all__ = [
    "Action", "Kind", "Schedule", "ScheduleError", "SCHEDULES",
    "generate", "check_params", "forward_only", "lower", "add_comms", "add_optimizer_step",
    "validate", "simulate", "SimResult", "stash_timeline", "StashResult", "render_grid", "to_chrome_trace", "render_png",
]
