"""`meshpipe` command line: run, plan, submit, jobs, status, logs.

    meshpipe [--version] [-v] COMMAND ...
    meshpipe run JOB.yaml [--cluster CLUSTER.yaml] [--address ADDR] [--set key.path=value ...]
                          [--reference] [--resume [STEP|auto] [--run-id ID]]
    meshpipe checkpoints JOB.yaml [--set ...]
    meshpipe export CKPT --to DIR
    meshpipe plan JOB.yaml [--cluster CLUSTER.yaml] [--set ...] [--json] [--png PATH] [--allow-code]
    meshpipe plan JOB.yaml --auto [--cluster C.yaml] [--out PATH] [--explain] [--top K] [--max-model M] [--measure K]
                                  [--no-calibrate | --recalibrate]
    meshpipe calibrate --cluster CLUSTER.yaml [--out PATH] [--force] [--json]
    meshpipe submit JOB.yaml [--cluster CLUSTER.yaml] [--address http://HOST:8265] [--set ...]
                             [--working-dir DIR] [--include PATH ...] [--max-upload-mb N]
                             [--follow/--no-follow] [--no-wait] [--timeout S]
    meshpipe jobs [--address http://HOST:8265]
    meshpipe status SUBMISSION_ID [--address http://HOST:8265]
    meshpipe logs SUBMISSION_ID [--address http://HOST:8265] [--follow]
    meshpipe prepare INPUTS... --out DIR (--tokenizer FILE | --train-tokenizer VOCAB) [--shard-tokens N]

`--set` takes job keys (`run.steps=3`) and, with a `cluster.` prefix, cluster
keys (`cluster.timeouts.step_s=60`). The job file's directory and the working
directory are put on the import path (driver, planner worker and stage actors), so
a `module:factory` model beside the job, or `examples.llama_model:pipeline` from
the repo root, imports without PYTHONPATH.

Config errors print one line per problem (key, value, rule) and exit with 2
before anything starts. Every `run` writes its record into a directory of its own,
`<run.output_dir>/<run.name>/<run id>/` (`latest` names the newest; `--resume` continues it;
`orchestrator.driver.rundir`), so running a job again never replaces an earlier record
(`--overwrite` is no longer needed and only says so). `run` exits 1 when a stage fails (the cause and the stage's
traceback on stderr, the full one in `<run dir>/error.txt`) and 130 on Ctrl-C or
SIGTERM. submit/status exit with the job's outcome: 0 SUCCEEDED, 1 FAILED,
3 STOPPED; 4 cannot reach or authenticate to the cluster, 5 --timeout, 6 no
such job, 130 interrupted (the job keeps running). See `orchestrator.driver.jobs`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

# The embedded local cluster used without --cluster. It ships inside the package (package data,
# see pyproject), so a non-editable install finds it from any directory; cluster_configs/local.yaml
# in the repository is the documented copy of the same file (tests/test_packaging.py keeps them equal).
DEFAULT_CLUSTER = Path(__file__).resolve().with_name("local_cluster.yaml")


CLUSTER_PREFIX = "cluster."

# What an error makes `meshpipe` print and exit with: one mapping for every command. Each entry is
# (the class's module, its name, the exit code, what the message starts with; `{failed}` is the
# command's own words for a failure of what it ran). The first class the error is an instance of
# wins, matched through the error's type and its bases (`exit_of`): nothing is imported to look,
# so a command that never loaded Ray or the planner does not load them to report an error.
EXITS = (
    ("orchestrator.core.config.errors", "ConfigError", 2, "invalid configuration:\n"),
    ("orchestrator.core.checkpoint", "CheckpointError", 2, "checkpoint: "),
    ("orchestrator.core.planner.search", "PlanningError", 2, "no plan: "),
    ("orchestrator.core.planner.calibrate", "CalibrationError", 2, "calibrate: "),
    ("orchestrator.core.planner.profile", "ProfileError", 1, "profiling failed: "),
    ("orchestrator.driver.rundir", "RunDirError", 2, ""),
    ("orchestrator.core.backends.base", "PlacementError", 1, "{failed}: "),
    ("orchestrator.driver.waiting", "StageFailure", 1, "{failed}: "),
    ("orchestrator.core.private_fs", "DiskFullError", 1, "{failed}: "),
    ("orchestrator.core.health", "HealthStop", 1, "{failed}: "),
    ("builtins", "TimeoutError", 1, "{failed}: "),
)
RUNTIME = (("builtins", "RuntimeError", 1, "{failed}: "),)   # for the commands whose runs report them


def exit_of(e: BaseException, table=EXITS) -> tuple[int, str] | None:
    """(exit code, message prefix) of `e` by `table` (`EXITS`), or None: not an error the CLI reports.

    Example:
        >>> from orchestrator.core.checkpoint import CheckpointError
        >>> exit_of(CheckpointError("no commit")), exit_of(TimeoutError()), exit_of(KeyError("x"))
        ((2, 'checkpoint: '), (1, '{failed}: '), None)
    """
    names = {(c.__module__, c.__qualname__) for c in type(e).__mro__}
    return next(((code, prefix) for module, name, code, prefix in table if (module, name) in names), None)


@contextlib.contextmanager
def reporting(failed: str = "run failed", table=EXITS, after: str = ""):
    """Run the block; an error `table` knows ends the process with its code and a one-line message
    on stderr (`meshpipe: <prefix><error>`, then `after` where the prefix is the command's
    `{failed}`), without a driver traceback; any other propagates."""
    try:
        yield
    except Exception as e:
        found = exit_of(e, table)
        if found is None:
            raise
        code, prefix = found
        tail = after if "{failed}" in prefix else ""
        click.echo(f"meshpipe: {prefix.format(failed=failed)}{e}{tail}", err=True)
        sys.exit(code)


def split_overrides(overrides: tuple[str, ...] | list[str]) -> tuple[list[str], list[str]]:
    """(job overrides, cluster overrides): `cluster.KEY=VALUE` goes to the cluster file as `KEY=VALUE`.

    Example:
        >>> split_overrides(["run.steps=3", "cluster.timeouts.step_s=60"])
        (['run.steps=3'], ['timeouts.step_s=60'])
    """
    job = [o for o in overrides if not o.startswith(CLUSTER_PREFIX)]
    cluster = [o[len(CLUSTER_PREFIX):] for o in overrides if o.startswith(CLUSTER_PREFIX)]
    return job, cluster


def job_import_dir(job_path: str) -> str:
    """The job file's directory, then the directory meshpipe was started in (as `python -m` has
    it), put first on the import path of this process and of the processes it starts (the
    planner's profiling worker, a local Ray's actors): a `module:factory` beside the job file, or
    a `package.module:factory` under the working directory (`examples.llama_model:pipeline` from
    the repo root), imports without PYTHONPATH. Returns them joined with os.pathsep."""
    dirs = list(dict.fromkeys([str(Path(job_path).resolve().parent), str(Path.cwd())]))
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    have = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dirs + [p for p in have if p not in dirs])
    return os.pathsep.join(dirs)


def _refuse_code(job, command: str) -> None:
    """Raise ConfigError when `job` names code (model or data factory): `command` runs it only when asked."""
    from orchestrator.core.config import ConfigError
    from orchestrator.core.config.check import job_code
    from orchestrator.core.config.errors import problem

    refs = job_code(job)
    if refs:
        raise ConfigError([problem(key, value, f"names code that `meshpipe {command}` would import and call to "
                                               "describe the job; pass --allow-code if you trust this job file "
                                               "(docs/security.md)") for key, value in refs])


def _checked(job_path: str, cluster_path: str | None, overrides: tuple[str, ...], address: str | None = None,
             allow_code: bool = True, command: str = "run"):
    import dataclasses

    from orchestrator.core.config import check_output_dir, load_cluster, load_job

    job_sets, cluster_sets = split_overrides(overrides)
    import_dir = job_import_dir(job_path)
    with reporting():
        job = load_job(job_path, overrides=job_sets)
        if not allow_code:
            _refuse_code(job, command)
        # --address: a running Ray replaces the file's address (whose num_cpus is then meaningless)
        cluster = load_cluster(cluster_path or str(DEFAULT_CLUSTER),
                               overrides=cluster_sets + ([f"address={address}", "num_cpus=null"] if address else []))
        checked = _check_with_code(job, cluster)
        return dataclasses.replace(checked, import_dir=import_dir), check_output_dir


def _check_with_code(job, cluster):
    """`check_job`, for a job that names code (model / data factory) only after that code returned in a
    child process within `cluster.timeouts.factory_s`, and then under a watchdog (`driver.usercode`)."""
    from orchestrator.core.config import check_job
    from orchestrator.core.config.check import job_code
    from orchestrator.driver.usercode import guard, watchdog

    refs = job_code(job)
    if not refs:
        return check_job(job, cluster)
    guard(job, cluster.timeouts.factory_s)
    what = "describing the job (" + ", ".join(f"{k} = {v!r}" for k, v in refs) + ")"
    with watchdog(2 * cluster.timeouts.factory_s, what):
        return check_job(job, cluster)


job_arg = click.argument("job", type=click.Path(exists=True, dir_okay=False))
cluster_opt = click.option("--cluster", type=click.Path(exists=True, dir_okay=False), default=None,
                           help="cluster YAML (default: the packaged copy of cluster_configs/local.yaml, an embedded local Ray)")
set_opt = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                       help="override one job key, e.g. --set run.steps=3, or a cluster key with a "
                            "'cluster.' prefix, e.g. --set cluster.timeouts.step_s=60 (repeatable)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshpipe")
    except PackageNotFoundError:
        return "unknown (not installed)"


def driver_cpu_only() -> None:
    """Keep any jax the driver uses (optax lookups, `--reference`) off accelerators.

    The driver never needs an accelerator, and on a TPU VM initialising jax's TPU
    backend would grab the chips the stage actors need. The CLI calls this once,
    before anything imports jax; library callers (a notebook calling `check_job`)
    keep their own platform.
    """
    os.environ["JAX_PLATFORMS"] = "cpu"


@click.group()
@click.version_option(version=_version(), prog_name="meshpipe", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True,
              help="show what is quiet by default: Ray's and the actors' own log noise (e.g. jax's "
                   "os.fork() warning, Gloo's connection lines)")
def main(verbose):
    """meshpipe: pipelined, mesh-sharded JAX training on Ray."""
    driver_cpu_only()
    from orchestrator.driver.quiet import quiet

    if not verbose:
        quiet()


def resume_command(job: str, cluster: str | None, overrides: tuple[str, ...], address: str | None) -> str:
    """This `meshpipe run`'s own arguments with `--resume`: the command that continues it.

    >>> resume_command("job.yaml", None, ("run.steps=8",), None)
    'meshpipe run job.yaml --set run.steps=8 --resume'
    """
    import shlex

    words = ["meshpipe", "run", job]
    if cluster:
        words += ["--cluster", cluster]
    for o in overrides:
        words += ["--set", o]
    if address:
        words += ["--address", address]
    return shlex.join(words + ["--resume"])


@main.command()
@job_arg
@cluster_opt
@set_opt
@click.option("--reference", is_flag=True, help="train in one process with plain JAX (the numerical oracle)")
@click.option("--address", default=None, metavar="ADDR",
              help="connect to this running Ray ('auto', host:port) instead of the cluster file's address "
                   "(what `meshpipe submit` uses inside the job)")
@click.option("--overwrite", is_flag=True, hidden=True,
              help="no longer needed: every run gets its own directory (accepted, and says so)")
@click.option("--resume", default=None, is_flag=False, flag_value="latest", metavar="[STEP|auto]",
              help="continue from the newest committed checkpoint in checkpoint.dir, or from STEP; "
                   "'auto': from the newest one if any is committed, else start at step 0 (what "
                   "`meshpipe submit` runs, so the same submission again continues). The record "
                   "goes on in the latest run directory (or --run-id's)")
@click.option("--run-id", default=None, metavar="ID",
              help="with --resume: the run directory to continue, <run.output_dir>/<run.name>/ID "
                   "(default: the one `latest` names)")
def run(job, cluster, overrides, reference, address, overwrite, resume, run_id):
    """Train JOB on the cluster (or, with --reference, in this process).

    Each run writes its record (summary.json, metrics.jsonl, workers.json, trace.json,
    timeline.png) into a new directory <run.output_dir>/<run.name>/<UTC start time>/;
    `latest` there names the newest."""
    from orchestrator.core.config import check_checkpoint_dir, checkpoint_bytes
    from orchestrator.core.tls import check_transport_tls
    from orchestrator.driver.runner import run_job

    if resume is not None and resume not in ("latest", "auto") and not (resume.isdigit() and int(resume) > 0):
        click.echo(f"meshpipe: --resume {resume!r}: must be a step number (a positive integer), 'auto' (the "
                   "newest committed step if there is one, else step 0) or absent (the newest committed step)",
                   err=True)
        sys.exit(2)
    if run_id is not None and resume is None:
        click.echo(f"meshpipe: --run-id {run_id}: only with --resume (a new run gets a new directory)", err=True)
        sys.exit(2)
    checked, check_output_dir = _checked(job, cluster, overrides, address)
    with reporting():
        check_output_dir(checked.job)
        check_checkpoint_dir(checked.job, 0 if reference else checkpoint_bytes(checked))   # --reference saves none
        if not reference:
            check_transport_tls(checked.cluster)
    if overwrite:
        click.echo("meshpipe: --overwrite is no longer needed: every run writes into a new directory under "
                   f"{Path(checked.job.run.output_dir) / checked.job.run.name}/ and nothing is replaced", err=True)
    from orchestrator.driver.interrupt import stop_on_signals, stopped_message

    with stop_on_signals() as stop:
        try:   # the run was torn down already when an error arrives here (runner's finally)
            with reporting("run failed"):
                run_job(checked, reference=reference, echo=lambda s: click.echo(s), tty=sys.stdout.isatty(),
                        resume=resume, resume_command=resume_command(job, cluster, overrides, address),
                        run_id=run_id)
        except KeyboardInterrupt as e:   # Ctrl-C or SIGTERM (interrupt.stop_on_signals); all torn down
            click.echo(f"\nmeshpipe: {stopped_message(stop, e)}", err=True)
            sys.exit(130)


@main.command()
@job_arg
@cluster_opt
@set_opt
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--png", type=click.Path(dir_okay=False), default=None, help="write the simulated timeline PNG")
@click.option("--auto", is_flag=True, help="choose stages, submeshes, layouts, microbatches and schedule "
              "from the cost model; print the best candidates and write the winner as a job YAML")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="--auto: where to write the winning job (default: JOB's name + .auto.yaml beside it)")
@click.option("--explain", "explain_", is_flag=True, help="--auto: show why the winner wins")
@click.option("--top", type=click.IntRange(1), default=5, show_default=True, help="--auto: candidates shown")
@click.option("--max-model", type=click.IntRange(1), default=None,
              help="--auto: largest `model` mesh axis (default: devices per host × hosts per node group)")
@click.option("--microbatches", default=None, metavar="M1,M2,...", help="--auto: microbatch counts to try")
@click.option("--target-step-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--auto: fail unless a plan is predicted at most this fast")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="--auto: per-layer compile cache (default: ~/.cache/meshpipe/planner)")
@click.option("--measure", type=click.IntRange(0), default=0, metavar="K",
              help="--auto: run the top K candidates for a few steps on the cluster (starts Ray); "
                   "predicted vs measured")
@click.option("--allow-code", is_flag=True,
              help="allow a job that names code (model.factory, data.factory): plan imports and calls it")
@click.option("--no-calibrate", is_flag=True,
              help="--auto: plan an uncalibrated cluster from nominal figures (marked so) instead of "
                   "calibrating it first")
@click.option("--recalibrate", is_flag=True,
              help="--auto: measure the cluster again even if a cached calibration of it exists")
def plan(job, cluster, overrides, as_json, png, auto, out, explain_, top, max_model, microbatches,
         target_step_ms, cache_dir, measure, allow_code, no_calibrate, recalibrate):
    """Show placement, schedule and simulated bubble without starting Ray (--auto: plan it for you).

    --auto prices plans with the cluster's measured figures: a cluster file without them is
    calibrated first (`meshpipe calibrate`, a few minutes, starts Ray), once — the result is
    cached per cluster file and machine in ~/.cache/meshpipe/calibrated/ — unless
    --no-calibrate, which plans from nominal figures and says so. The winning job is written
    with run.name <name>-auto.

    A job that names code (`model.factory`, a `package.module:function` model name, `data.factory`)
    is refused unless --allow-code is given: describing its model means importing and calling
    that code (docs/security.md)."""
    from orchestrator.core.plan import make_plan, plan_json, plan_text

    if auto and not allow_code:
        from orchestrator.core.config import load_job

        with reporting():
            _refuse_code(load_job(job, overrides=split_overrides(overrides)[0]), "plan")
    if auto:
        _auto(job, cluster, overrides, out, explain_, top, max_model, microbatches, target_step_ms, cache_dir, as_json,
              measure, not no_calibrate, recalibrate)
        return
    checked, _ = _checked(job, cluster, overrides, allow_code=allow_code, command="plan")
    p = make_plan(checked)
    if png:
        from orchestrator.core.schedule import render_png

        render_png(p.sim, p.schedule, png, title=f"{checked.job.run.name}: {checked.job.pipeline.schedule}")
        click.echo(f"wrote {Path(png).resolve()}", err=as_json)   # stdout stays pure JSON with --json
    if as_json:
        click.echo(json.dumps(plan_json(p), indent=1))
    else:
        click.echo(plan_text(p))


@main.command()
@job_arg
@set_opt
def checkpoints(job, overrides):
    """List JOB's committed checkpoints (step, time, size, layout)."""
    from orchestrator.core.config import load_job
    from orchestrator.driver.checkpoint import listing

    with reporting():
        cfg = load_job(job, overrides=list(overrides))
    if cfg.checkpoint is None:
        click.echo("meshpipe: the job has no `checkpoint:` section", err=True)
        sys.exit(2)
    with reporting():
        lines = listing(cfg.checkpoint.dir)
    click.echo("\n".join(lines) if lines else f"no committed checkpoint in {cfg.checkpoint.dir}")


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "to", required=True, type=click.Path(), help="new directory for the consolidated checkpoint")
def export(ckpt, to):
    """Write committed checkpoint CKPT (a step_<N> directory) as one plain JAX/orbax checkpoint in DIR."""
    from orchestrator.driver.checkpoint import export as export_ckpt

    with reporting():
        info = export_ckpt(ckpt, to)
    click.echo(f"exported step {info['step']} of {info['model']} ({len(info['names'])} parameters) to {to}")


def _auto(job, cluster, overrides, out, explain_, top, max_model, microbatches, target_step_ms, cache_dir, as_json,
          measure, calibrate: bool = True, recalibrate: bool = False):
    from orchestrator.driver import autocal
    from orchestrator.driver.autoplan import auto_plan

    job_import_dir(job)
    with reporting():
        from orchestrator.core.config import load_cluster, load_job
        from orchestrator.driver.usercode import guard

        job_sets, cluster_sets = split_overrides(overrides)    # the job's code returns in time, first
        guard(load_job(job, overrides=job_sets),
              load_cluster(cluster or str(DEFAULT_CLUSTER), overrides=cluster_sets).timeouts.factory_s)
    try:
        ms = tuple(int(x) for x in microbatches.split(",")) if microbatches else None
    except ValueError:
        click.echo(f"meshpipe: --microbatches = {microbatches!r}: must be positive integers separated by commas, "
                   "e.g. 4,8", err=True)
        sys.exit(2)
    cluster = cluster or str(DEFAULT_CLUSTER)
    with json_stdout(as_json) as echo:   # calibrating and --measure start Ray: its lines go to stderr
        say = (lambda s: click.echo(s, err=True)) if as_json else echo
        with reporting("calibrating the cluster failed", EXITS + RUNTIME,
                       after=" (--no-calibrate plans from nominal figures instead)"):
            calibration = autocal.resolve(cluster, calibrate=calibrate, recalibrate=recalibrate, echo=say)
        # --measure: a candidate's run that failed (torn down already) is "measuring failed"
        with reporting("measuring failed", EXITS + RUNTIME):
            auto_plan(job, cluster, overrides, out=out, explain_=explain_, top=top,
                      max_model=max_model, microbatches=ms, target_step_ms=target_step_ms, cache_dir=cache_dir,
                      as_json=as_json, echo=echo, measure=measure, calibration=calibration)


@main.command()
@click.option("--cluster", "cluster", required=True, type=click.Path(exists=True, dir_okay=False),
              help="the cluster YAML to measure (address: null starts an embedded local Ray, as `run` does)")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="where to write the calibrated cluster (default: CLUSTER's name + .calibrated.yaml beside "
                   "it); never the input file")
@click.option("--force", is_flag=True, help="replace --out if it exists (the input file is never replaced)")
@click.option("--json", "as_json", is_flag=True, help="print the measurements as JSON")
def calibrate(cluster, out, force, as_json):
    """Measure the cluster's devices, link classes and per-action runtime cost; write them as a new
    cluster YAML (`device:`, `links:`) for `meshpipe plan --auto`."""
    from orchestrator.driver.calibrate import calibrate as run_calibration

    with reporting("calibrate failed", EXITS + RUNTIME), json_stdout(as_json) as echo:
        # the probes' forwarded lines go to stderr with --json
        report = run_calibration(cluster, out=out, force=force, echo=(lambda s: None) if as_json else echo)
    if as_json:
        click.echo(json.dumps(report, indent=1))


@contextlib.contextmanager
def json_stdout(as_json: bool):
    """Yield an echo to this process's stdout. With --json, stdout must hold the JSON document
    alone, so meanwhile anything else printed there goes to stderr: Ray prints the actors'
    forwarded output to `sys.stdout` as it is at that moment (a probe's stray line broke
    `calibrate --json | jq` before)."""
    out = sys.stdout

    def echo(s: str) -> None:
        click.echo(s, file=out)

    if not as_json:
        yield echo
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield echo


address_opt = click.option("--address", envvar="RAY_API_SERVER_ADDRESS", default=None,
                           help="the Ray dashboard (Jobs API) address, e.g. http://HEAD:8265; env "
                                "RAY_API_SERVER_ADDRESS. Default: the cluster RAY_ADDRESS names, else the one "
                                "`ray start` last started on this machine, asked for its dashboard")


def _fail(e) -> None:
    click.echo(f"meshpipe: {e}", err=True)
    sys.exit(e.code)


def _dashboard(address: str | None) -> str:
    """--address, or the cluster's dashboard found (`jobs.find_dashboard`, said on stderr); exit 4 if none."""
    from orchestrator.driver import jobs

    try:
        url, how = jobs.find_dashboard(address)
    except jobs.JobsError as e:
        _fail(e)
    if not address:
        click.echo(f"meshpipe: Ray dashboard {url} (from {how})", err=True)
    return url


@main.command()
@job_arg
@cluster_opt
@set_opt
@address_opt
@click.option("--working-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="the directory the job's files are shipped relative to; the run starts there on the "
                   "cluster (default: the job file's)")
@click.option("--follow/--no-follow", default=True, show_default=True, help="stream the job's logs until it ends")
@click.option("--no-wait", is_flag=True, help="return right after submitting (exit 0)")
@click.option("--timeout", type=float, default=None, help="stop waiting after this many seconds (exit 5)")
@click.option("--overwrite", is_flag=True, hidden=True,
              help="no longer needed: every run gets its own directory (accepted, and says so)")
@click.option("--include", "include", multiple=True, type=click.Path(exists=True), metavar="PATH",
              help="ship this file or directory too (one the job's code opens itself; repeatable)")
@click.option("--max-upload-mb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="refuse to upload more than this (default 100 MiB)")
def submit(job, cluster, overrides, address, working_dir, follow, no_wait, timeout, overwrite, include,
           max_upload_mb):
    """Submit JOB to a running Ray cluster as a Ray Job; exit with its outcome.

    Ships only what the job needs: the job and cluster files, the code it names and the local
    modules that code imports, its data files (and --include paths), at their places under the
    working dir — never earlier runs, checkpoints, caches or a virtualenv beside them."""
    import shutil

    from orchestrator.driver import jobs, shipping

    checked, _ = _checked(job, cluster, overrides, address="auto")
    if overwrite:
        click.echo("meshpipe: --overwrite is no longer needed: every run writes into a new directory under "
                   "<run.output_dir>/<run.name>/ and nothing is replaced", err=True)
    address = _dashboard(address)
    try:
        pkg = jobs.package(checked, job, cluster, overrides, address, working_dir, include=include,
                           limit_bytes=None if max_upload_mb is None else int(max_upload_mb * 2**20))
    except jobs.JobsError as e:
        _fail(e)
    for w in pkg.warnings:
        click.echo(f"meshpipe: warning: {w}", err=True)
    ship = pkg.shipment
    click.echo(f"meshpipe: shipping {len(ship.files)} file(s), {shipping.size_text(ship.nbytes)}, from "
               f"{pkg.working_dir}: {ship.listing()}", err=True)
    headers, where = jobs.auth_headers()
    click.echo(f"meshpipe: {where}", err=True)
    staged = shipping.stage(ship)
    try:
        c = jobs.client(address)
        sid = jobs.bounded(lambda: c.submit_job(entrypoint=pkg.entrypoint,
                                                runtime_env={**pkg.runtime_env, "working_dir": str(staged)},
                                                submission_id=pkg.submission_id,
                                                metadata={"meshpipe_run": pkg.run}),
                           timeout=120, what="submitting (uploading the job's files)")
    except jobs.JobsError as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001 - Ray raises several types; say which and why
        _fail(jobs.JobsError(jobs.explain(e, address)))
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    from orchestrator.core.redact import redact_text

    click.echo(f"submitted {sid}  (run {pkg.run}, working dir {pkg.working_dir})")
    click.echo(f"  entrypoint: {redact_text(pkg.entrypoint)}")
    for line in jobs.commands(sid, address, bool(headers)):
        click.echo(f"  {line}")
    if no_wait:
        return
    _wait(c, sid, address, follow, timeout)


def _wait(c, sid: str, address: str, follow: bool, timeout: float | None) -> None:
    from orchestrator.driver import jobs

    try:
        if follow:
            status = jobs.follow(c, sid, lambda chunk: click.echo(chunk, nl=False), timeout)
        else:
            status = jobs.wait_for_end(c, sid, timeout)
        info = jobs.bounded(c.get_job_info, sid, what="job info")
    except KeyboardInterrupt:
        click.echo(f"\nmeshpipe: stopped waiting; job {sid} keeps running "
                   f"(meshpipe status {sid} --address {address})", err=True)
        sys.exit(jobs.EXIT_INTERRUPTED)
    except jobs.JobsError as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001 - the log stream or status call failed; say why
        _fail(jobs.JobsError(jobs.explain(e, address)))
    click.echo(f"job {sid}: {status}" + (f" ({info.message})" if getattr(info, "message", None) else ""))
    sys.exit(jobs.EXIT_CODES.get(status, 0))


@main.command()
@click.argument("submission_id")
@address_opt
def status(submission_id, address):
    """Print a submitted job's status (exit 1 FAILED, 3 STOPPED, else 0)."""
    from orchestrator.driver import jobs

    address = _dashboard(address)
    try:
        c = jobs.client(address)
        info = jobs.bounded(c.get_job_info, submission_id, what="job info")
    except jobs.JobsError as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001
        _fail(jobs.unknown_job(e, address, submission_id) or jobs.JobsError(jobs.explain(e, address)))
    state = str(info.status).split(".")[-1]
    click.echo(f"{submission_id}: {state}" + (f" ({info.message})" if info.message else ""))
    click.echo(f"  entrypoint: {info.entrypoint}")
    sys.exit(jobs.EXIT_CODES.get(state, 0))


@main.command()
@click.argument("submission_id")
@address_opt
@click.option("--follow", is_flag=True, help="keep streaming until the job ends (exit with its outcome)")
def logs(submission_id, address, follow):
    """Print a submitted job's logs."""
    from orchestrator.driver import jobs

    address = _dashboard(address)
    try:
        c = jobs.client(address)
        if not follow:
            click.echo(jobs.bounded(c.get_job_logs, submission_id, what="job logs"), nl=False)
            return
    except jobs.JobsError as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001
        _fail(jobs.unknown_job(e, address, submission_id) or jobs.JobsError(jobs.explain(e, address)))
    _wait(c, submission_id, address, True, None)


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="directory for the shards and index.json (data.path of a `source: tokens` job)")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a tokenizers JSON file to encode with")
@click.option("--train-tokenizer", "train_vocab", type=click.IntRange(min=258), default=None, metavar="VOCAB",
              help="train a byte-level BPE tokenizer of VOCAB tokens on INPUTS first (OUT/tokenizer.json)")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=1 << 24, show_default=True,
              help="largest shard, in tokens")
def prepare(inputs, out_dir, tokenizer, train_vocab, shard_tokens):
    """Turn text files (or directories of them) into token shards for `data.source: tokens`."""
    from orchestrator.driver.prepare import prepare as run_prepare

    try:
        doc = run_prepare(inputs, out_dir, tokenizer=tokenizer, train_vocab=train_vocab,
                          shard_tokens=shard_tokens, progress=click.progressbar)
    except (ValueError, ImportError, OSError) as e:
        click.echo(f"meshpipe prepare: {e}", err=True)
        sys.exit(2)
    total = sum(s["tokens"] for s in doc["shards"])
    click.echo(f"wrote {len(doc['shards'])} shard(s), {total} tokens ({doc['dtype']}, vocab {doc['vocab']}) "
               f"to {out_dir}")


@main.command(name="jobs")
@address_opt
def list_jobs(address):
    """List the meshpipe runs submitted to the cluster (newest last)."""
    from orchestrator.driver import jobs

    address = _dashboard(address)
    try:
        c = jobs.client(address)
        rows = jobs.bounded(c.list_jobs, what="job list")
    except jobs.JobsError as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001
        _fail(jobs.JobsError(jobs.explain(e, address)))
    for line in jobs.job_table(rows):
        click.echo(line)


if __name__ == "__main__":
    main()
