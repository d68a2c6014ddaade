"""Do two meshpipe source trees run the same XLA programs? The deterministic half of "is a refactor free?".

Run:  python -m benchmarks.same_programs --before DIR [--before-python PY] [--size large] [--out FILE]

`benchmarks.trees` times two trees' steps in alternated pairs, but on this VM the same XLA
programs run up to ~35 % faster or slower from one process to the next, so a few percent
cannot be resolved from wall time at `large` in any affordable number of pairs. This
answers the other half exactly: one child process per tree (`TREE/… python -m
benchmarks.same_programs child SIZE`, that tree first on its path) builds the stage programs
of the pipeline benchmark's job (`benchmarks.pipeline.stage_chunks`: the GPT of
`benchmarks.common.SIZES`, 2 stages, 1F1B) on a one-device mesh with layout batch → data,
as the stage worker builds them, then lowers and compiles each program a step runs — the
forward (`jitted_fwd`), the backward with accumulation (`bwd_acc`), the loss chunk's forward
and backward as one program (`fwd_bwd_acc`), the update (`update`, and `update_checked`
where the tree has it) — with the operands the worker gives them, and hashes XLA's
optimized HLO text with what only names the source removed (op metadata, the source-file
and stack-frame tables, module and jit names). Equal hashes: the same computation,
compiled the same way, so any difference in their time is the process's, not the tree's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\s*$")


def normalized(hlo: str) -> str:
    """Optimized HLO text without what names the source: op metadata, stack-frame ids and
    tables, the module's and jitted functions' names, the entry parameters' names (JAX names
    them after the Python arguments)."""
    entry = re.findall(r"^\s*%([\w.\-]+) = .*? parameter\((\d+)\)", hlo.split("\nENTRY ", 1)[-1], re.M)
    for name, k in entry:
        hlo = re.sub(rf"(?<![\w.\-]){re.escape(name)}(?![\w.\-])", f"arg{k}", hlo)
    out, in_table = [], False
    for line in hlo.splitlines():
        if _TABLES.match(line):
            in_table = True
            continue
        if in_table:
            if line.strip() == "":
                in_table = False
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r",?\s*stack_frame_id=\d+", "", line)
        line = re.sub(r"HloModule \S+", "HloModule m", line)
        out.append(re.sub(r"jit_\w+", "jit_f", line))
    return "\n".join(out)


def child(size_name: str) -> dict:
    """{"stage<i>/<program>": sha1 of its normalized optimized HLO} in this process's tree."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks.common import LEARNING_RATE, SIZES
    from benchmarks.pipeline import stage_chunks
    from orchestrator.core.data.plan import synthetic_plan
    from orchestrator.core.model.registry import build_model, build_spec
    from stages.data import microbatch, synthetic_batch
    from stages.program import StageProgram, make_optimizer

    size, m = SIZES[size_name], 8
    spec = build_spec("gpt", size.model_args(), size.seq)
    model = build_model(spec.factory, spec.args)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x0, y0 = synthetic_batch(synthetic_plan(spec, size.mbs * m, 0), 0)
    xs, labels = [microbatch(x0, 0, m)], microbatch(y0, 0, m)
    ids, gnorm = np.array([0, 0, 0], np.int32), np.float32(0.0)

    def digest(jitted, *args) -> str:
        text = normalized(jitted.lower(*args).compile().as_text())
        return hashlib.sha1(text.encode()).hexdigest()

    out = {}
    ranges = sorted(c for cs in stage_chunks(size, "1f1b") for c in cs)
    for i, (a, b) in enumerate(ranges):
        prog = StageProgram(spec, model, a, b, microbatches=m, mesh=mesh, layout={"batch": "data"},
                            optimizer=make_optimizer("adam", {"learning_rate": LEARNING_RATE}))
        params = prog.init_params(0)
        opt_state, grads = prog.init_state(params)
        lab = labels if prog.last else None
        y, res = prog.fwd(params, xs, lab, ids)
        dys = None if prog.last else [np.ones(y[k].shape, np.dtype(y[k].dtype)) for k in prog.out_diff]
        out[f"stage{i}/fwd"] = digest(prog.jitted_fwd(), params, xs, lab, ids)
        out[f"stage{i}/bwd_acc"] = digest(prog.bwd_acc, params, res, dys, grads)
        if prog.last:
            out[f"stage{i}/fwd_bwd_acc"] = digest(prog.fwd_bwd_acc, params, xs, lab, ids, grads)
        for name in ("update", "update_checked"):
            if hasattr(prog, name):
                out[f"stage{i}/{name}"] = digest(getattr(prog, name), params, opt_state, grads, gnorm)
        if not prog.last:
            xs = [np.asarray(leaf) for leaf in y]
    return {"programs": out, "jax": jax.__version__}


def compare(before: dict, after: dict) -> dict:
    """Per program both trees build: same or different; and the programs only one tree has."""
    b, a = before["programs"], after["programs"]
    return {"same": sorted(k for k in b if k in a and a[k] == b[k]),
            "different": sorted(k for k in b if k in a and a[k] != b[k]),
            "only_before": sorted(set(b) - set(a)), "only_after": sorted(set(a) - set(b)),
            "jax": {"before": before["jax"], "after": after["jax"]}}


def main(argv: list[str]) -> None:
    if argv and argv[0] == "child":
        print(json.dumps(child(argv[1])))
        return
    from benchmarks.common import before_tree, emit, machine_info, run_in_tree, two_tree_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    two_tree_args(ap)
    ap.add_argument("--size", default="large")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    (before, before_py), script = before_tree(ap, args), str(Path(__file__).resolve())
    emit({"machine": machine_info(), "size": args.size, "trees": {"before": str(before), "after": str(HERE)},
          **compare(run_in_tree(script, before, before_py, [args.size], args.timeout),
                    run_in_tree(script, HERE, sys.executable, [args.size], args.timeout))}, args.out)

if __name__ == "__main__":
    main(sys.argv[1:])
