"""Layer 3: the driver runtime — placement, executors and dispatch, runner, Ray Jobs,
telemetry aggregation, metrics and the CLI. Imports `orchestrator.core` and `stages`.
"""
