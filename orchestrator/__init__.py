"""meshpipe's planning and driver side, in two layers (the actor runtime is `stages`).

Three layers, imports in one direction (enforced by tests/test_layers.py):

1. `orchestrator.core` — pure description and planning: config, models and
   layouts, schedules, reshard plans, backends' placement answers. Imports neither
   `ray` nor `stages`; needs no devices.
2. `stages` — the actor runtime: stage worker, stage programs, transport. Imports
   only `orchestrator.core`.
3. `orchestrator.driver` — placement, executors, runner, jobs, telemetry, CLI.
   Imports both.
"""
