"""`meshpipe` command line: run, plan.

    meshpipe run JOB.yaml [--cluster CLUSTER.yaml] [--set key.path=value ...] [--reference]
    meshpipe plan JOB.yaml [--cluster CLUSTER.yaml] [--set ...] [--json] [--png PATH]

Config errors print one line per problem (key, value, rule) and exit with 2
before anything starts.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

DEFAULT_CLUSTER = Path(__file__).resolve().parent.parent / "cluster_configs" / "local.yaml"


def _checked(job_path: str, cluster_path: str | None, overrides: tuple[str, ...]):
    from orchestrator.config import ConfigError, check_job, check_output_dir, load_cluster, load_job

    try:
        job = load_job(job_path, overrides=list(overrides))
        cluster = load_cluster(cluster_path or str(DEFAULT_CLUSTER))
        checked = check_job(job, cluster)
        return checked, check_output_dir
    except ConfigError as e:
        click.echo(f"meshpipe: invalid configuration:\n{e}", err=True)
        sys.exit(2)


job_arg = click.argument("job", type=click.Path(exists=True, dir_okay=False))
cluster_opt = click.option("--cluster", type=click.Path(exists=True, dir_okay=False), default=None,
                           help="cluster YAML (default: cluster_configs/local.yaml, an embedded local Ray)")
set_opt = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                       help="override one job key, e.g. --set run.steps=3 (repeatable)")


@click.group()
def main():
    """meshpipe: pipelined, mesh-sharded JAX training on Ray."""


@main.command()
@job_arg
@cluster_opt
@set_opt
@click.option("--reference", is_flag=True, help="train in one process with plain JAX (the numerical oracle)")
def run(job, cluster, overrides, reference):
    """Train JOB on the cluster (or, with --reference, in this process)."""
    from orchestrator.config import ConfigError
    from orchestrator.runner import run_job

    checked, check_output_dir = _checked(job, cluster, overrides)
    try:
        check_output_dir(checked.job)
    except ConfigError as e:
        click.echo(f"meshpipe: invalid configuration:\n{e}", err=True)
        sys.exit(2)
    run_job(checked, reference=reference, echo=lambda s: click.echo(s))


@main.command()
@job_arg
@cluster_opt
@set_opt
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--png", type=click.Path(dir_okay=False), default=None, help="write the simulated timeline PNG")
def plan(job, cluster, overrides, as_json, png):
    """Show placement, schedule and simulated bubble without starting Ray."""
    from orchestrator.plan import make_plan, plan_json, plan_text

    checked, _ = _checked(job, cluster, overrides)
    p = make_plan(checked)
    if png:
        from orchestrator.schedule import render_png

        render_png(p.sim, p.schedule, png, title=f"{checked.job.run.name}: {checked.job.pipeline.schedule}")
    if as_json:
        click.echo(json.dumps(plan_json(p), indent=1))
    else:
        click.echo(plan_text(p))


if __name__ == "__main__":
    main()
