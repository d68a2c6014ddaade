"""Per-layer profiles from XLA's compiled programs: requests, the HLO collective reader,
the on-disk cache and the profiling subprocess. No jax in this process.

Basic flow:
    reqs = [ProfileRequest(layer.signature, layer.index, model_size, rules, b) ...]
    profiles = Profiler(worker="stages.aot_profile", cache_dir=...).profile(model, reqs)

A request asks for one layer's forward, backward(+accumulate) and zero-bubble I and
W(+accumulate) (the backward cut in two as `stages.program` runs it) compiled on a
`(data=1, model=M)` mesh with `b` examples per data shard and layout rules
`rules` (logical axis → "model"; batch → data). Per device, a stage on a
`(D, M)` mesh with microbatch D·b runs exactly that program plus the gradient
all-reduce over `data`, which the cost model adds from the parameter bytes —
so compiles depend on (layer, M, rules, b), not on D or on which hosts.

Each profile is read from the compiled executable: `cost_analysis()` (flops,
bytes accessed), `memory_analysis()` (argument, output = the forward's residuals,
temp; for the loss layer also the temp of its F+B as one program, what
`pipeline.fuse_loss_chunk` runs), the collectives in `as_text()` (kind, bytes per device, replica groups
as positions along `model`) and the kernels there (`count_kernels`: the entry computation's
instructions that launch work — fusions, dots, copies, collectives — which the cost model charges a
per-kernel time each, `Topology.kernel_overhead_s`). Phases: "fwd", "bwd", and "i", "w" for the split backward, whose
profile also carries `held_bytes`, what I keeps for W per device (the kept residual and
output-cotangent leaves plus what I computes for W, from the I program's shapes and shardings),
and `split_temp_bytes`, the largest temp of F, I and W. The worker runs in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` and `JAX_PLATFORMS=cpu`
before jax is imported there; the caller's process and environment are never
touched. Results are cached as JSON files keyed by (worker protocol, jax
version, model source, layer signature, M, rules, b).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["ProfileRequest", "LayerProfile", "Profiler", "ProfileError", "parse_collectives",
           "count_kernels", "PROTOCOL", "linear"]

# 2: the loss layer's fused F+B temp (fused_temp_bytes); 3: the I and W phases, held_bytes;
# 4: each phase's kernel count (`kernels`)
PROTOCOL = 4
_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "s16": 2, "s8": 1,
                "u64": 8, "u32": 4, "u16": 2, "u8": 1, "pred": 1, "c64": 8, "c128": 16}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class ProfileError(RuntimeError):
    """The profiling worker failed or timed out (the message says which request and why)."""


@dataclass(frozen=True)
class ProfileRequest:
    """One layer program to profile (see the module docstring)."""

    signature: str
    layer: int = field(compare=False)       # which layer to build: any one with this signature
    model_size: int = 1
    rules: tuple[tuple[str, str], ...] = ()
    batch: int = 1

    def to_json(self) -> dict:
        return {"signature": self.signature, "layer": self.layer, "model_size": self.model_size,
                "rules": [list(r) for r in self.rules], "batch": self.batch}


@dataclass(frozen=True)
class LayerProfile:
    """Per-device figures of one layer's programs (forward "fwd", backward+accumulate "bwd", and
    where compiled the zero-bubble input-gradient "i" and weight-gradient+accumulate "w").

    `collectives`: (phase, kind, bytes, groups) with groups as tuples of positions
    along the `model` axis. `compile_s` is 0 for a profile read from the cache.
    `held_bytes`: what the I program keeps for W; `split_temp_bytes`: the largest temp of
    F, I and W (None for both when the split was not compiled). `kernels`: per phase, the
    compiled program's kernel count (`count_kernels`; empty for a synthetic profile).
    """

    flops: Mapping[str, float]
    bytes_accessed: Mapping[str, float]
    residual_bytes: float
    temp_bytes: float
    collectives: tuple[tuple[str, str, float, tuple[tuple[int, ...], ...]], ...]
    compile_s: float = 0.0
    cached: bool = False
    fused_temp_bytes: float | None = None   # the loss layer's F+B as one program (fuse_loss_chunk): its temp
    held_bytes: float | None = None         # zero-bubble: what I keeps for W, per device
    split_temp_bytes: float | None = None   # zero-bubble: the largest temp of F, I and W
    kernels: Mapping[str, int] = field(default_factory=dict)   # per phase: `count_kernels` of its program

    @property
    def split(self) -> bool:
        """Whether the zero-bubble I and W programs were profiled."""
        return "i" in self.flops and "w" in self.flops and self.held_bytes is not None

    def to_json(self) -> dict:
        return {"flops": dict(self.flops), "bytes_accessed": dict(self.bytes_accessed),
                "residual_bytes": self.residual_bytes, "temp_bytes": self.temp_bytes,
                "collectives": [[p, k, b, [list(g) for g in gs]] for p, k, b, gs in self.collectives],
                "compile_s": self.compile_s,
                **({"fused_temp_bytes": self.fused_temp_bytes} if self.fused_temp_bytes is not None else {}),
                **({"held_bytes": self.held_bytes} if self.held_bytes is not None else {}),
                **({"split_temp_bytes": self.split_temp_bytes} if self.split_temp_bytes is not None else {}),
                **({"kernels": dict(self.kernels)} if self.kernels else {})}

    @staticmethod
    def from_json(d: Mapping[str, Any], cached: bool = False) -> "LayerProfile":
        colls = tuple((str(p), str(k), float(b), tuple(tuple(int(x) for x in g) for g in gs))
                      for p, k, b, gs in d["collectives"])
        return LayerProfile({k: float(v) for k, v in d["flops"].items()},
                            {k: float(v) for k, v in d["bytes_accessed"].items()},
                            float(d["residual_bytes"]), float(d["temp_bytes"]), colls,
                            0.0 if cached else float(d.get("compile_s", 0.0)), cached,
                            *(None if d.get(k) is None else float(d[k])
                              for k in ("fused_temp_bytes", "held_bytes", "split_temp_bytes")),
                            kernels={str(k): int(v) for k, v in (d.get("kernels") or {}).items()})


def linear(p1: LayerProfile, p2: LayerProfile, b: float) -> LayerProfile:
    """The profile at batch b from profiles at batch 1 and 2, linear in the batch.

    Flops and bytes of batch-linear programs (matmuls, attention, elementwise) are
    exactly c0 + c1·b; memory sizes are close to it. Collectives are matched by
    (phase, kind, groups) and summed; one missing on a side counts as 0 bytes there. Kernel
    counts do not grow with the batch: batch 2's for b ≥ 2 (XLA simplifies some batch-1
    programs differently; a GPT block's counts at batch 2 and 4 are equal), else batch 1's.
    """
    def lin(a: float, c: float) -> float:
        return max(0.0, a + (c - a) * (b - 1))

    def lin_opt(a: float | None, c: float | None) -> float | None:
        return None if a is None or c is None else lin(a, c)

    keys = sorted(set(p1.flops) | set(p2.flops))
    c1: dict = {}
    c2: dict = {}
    for src, dst in ((p1, c1), (p2, c2)):
        for p, k, by, g in src.collectives:
            dst[(p, k, g)] = dst.get((p, k, g), 0.0) + by
    colls = tuple((p, k, lin(c1.get((p, k, g), 0.0), c2.get((p, k, g), 0.0)), g)
                  for (p, k, g) in sorted(set(c1) | set(c2)))
    return LayerProfile({k: lin(p1.flops.get(k, 0), p2.flops.get(k, 0)) for k in keys},
                        {k: lin(p1.bytes_accessed.get(k, 0), p2.bytes_accessed.get(k, 0)) for k in keys},
                        lin(p1.residual_bytes, p2.residual_bytes), lin(p1.temp_bytes, p2.temp_bytes),
                        tuple(c for c in colls if c[2] > 0),
                        fused_temp_bytes=lin_opt(p1.fused_temp_bytes, p2.fused_temp_bytes),
                        held_bytes=lin_opt(p1.held_bytes, p2.held_bytes),
                        split_temp_bytes=lin_opt(p1.split_temp_bytes, p2.split_temp_bytes),
                        kernels=dict(p2.kernels if b >= 2 else p1.kernels))


# ----------------------------------------------------------------------------- HLO collectives

_SHAPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP_RE = re.compile(r"=\s*(.+?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE_RE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def _braces(text: str, start: int) -> str:
    """The balanced {...} starting at text[start] == '{'."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    raise ValueError(f"unbalanced braces in {text[start:start + 80]!r}")


def _groups(line: str, n: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups of one HLO collective line, as tuples of device positions 0..n-1."""
    for key in ("replica_groups=", "source_target_pairs="):
        at = line.find(key)
        if at < 0:
            continue
        rest = line[at + len(key):]
        if rest.startswith("{"):
            body = _braces(rest, 0)
            inner = re.findall(r"\{([0-9,\s]*)\}", body[1:-1]) if body != "{}" else []
            if not inner:
                return (tuple(range(n)),)
            return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in inner)
        m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", rest)
        if m:
            shape = [int(x) for x in m.group(1).split(",")]
            dims = [int(x) for x in m.group(2).split(",")]
            ids = np.arange(math.prod(dims)).reshape(dims)
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
            return tuple(tuple(int(x) for x in row) for row in ids.reshape(shape[0], -1))
        m = re.match(r"mesh\[([^\]]*)\]", rest)
        if m:
            axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
            names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
            ids = np.arange(math.prod(sizes)).reshape(sizes)
            tail = rest[m.end():]
            d = re.match(r",\s*device_ids=\(", tail)
            if d:                                   # device_ids=([dims]T(perm)) or device_ids=(0,1,...)
                depth, end = 1, d.end()
                while depth and end < len(tail):
                    depth += {"(": 1, ")": -1}.get(tail[end], 0)
                    end += 1
                body, tail = tail[d.end():end - 1], tail[end:]
                it = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", body.strip())
                if it:
                    base = np.arange(math.prod(sizes)).reshape([int(x) for x in it.group(1).split(",")])
                    if it.group(2):
                        base = base.transpose([int(x) for x in it.group(2).split(",")])
                    ids = base.reshape(sizes)
                else:
                    ids = np.array([int(x) for x in body.split(",") if x.strip()]).reshape(sizes)
            c = re.match(r"\s*\{([^}]*)\}", tail)
            if not c:
                raise ValueError(f"cannot read replica groups {rest[:120]!r}")
            chosen = re.findall(r"'([^']+)'", c.group(1))
            keep = [names.index(x) for x in chosen]
            other = [i for i in range(len(names)) if i not in keep]
            moved = ids.transpose(other + keep).reshape(-1, math.prod(sizes[i] for i in keep) if keep else 1)
            return tuple(tuple(int(x) for x in row) for row in moved)
        raise ValueError(f"cannot read replica groups {rest[:120]!r}")
    return (tuple(range(n)),)


def parse_collectives(hlo_text: str, n: int) -> list[tuple[str, float, tuple[tuple[int, ...], ...]]]:
    """Every collective of a compiled (SPMD-partitioned) HLO module: (kind, bytes per device, groups).

    Bytes: the result for all-reduce / all-gather / all-to-all / collective-permute,
    the operand (result × group size) for reduce-scatter.

    Example:
        >>> parse_collectives("%a = f32[4,8]{1,0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%s", 4)
        [('all-reduce', 128.0, ((0, 1), (2, 3)))]
    """
    out = []
    for line in hlo_text.splitlines():
        m = _OP_RE.search(line)
        if not m or "-done" in line.split("=")[1][:60]:
            continue
        kind, shape_text = m.group(2), m.group(1)
        nbytes = _shape_bytes(shape_text)
        if m.group(3) and shape_text.startswith("("):   # async start: (operand, result, ...) tuple
            parts = _SHAPE_RE.findall(shape_text)
            if len(parts) >= 2:
                dtype, dims = parts[1]
                nbytes = (math.prod(int(d) for d in dims.split(",") if d) if dims else 1) * _DTYPE_BYTES[dtype]
        groups = _groups(line, n)
        if kind == "reduce-scatter":
            nbytes *= max(len(g) for g in groups)
        out.append((kind, float(nbytes), groups))
    return out


_NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                          "partition-id", "replica-id", "opt-barrier"})
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")


def count_kernels(hlo_text: str) -> int:
    r"""The kernels a compiled HLO module launches: instructions of its ENTRY computation other
    than parameters, constants, tuples, bitcasts and the like (a fusion is one kernel; an async
    collective's -start/-done pair counts once).

    Example:
        >>> count_kernels("HloModule m\n\nENTRY %main (p: f32[4]) -> f32[4] {\n"
        ...               "  %p = f32[4]{0} parameter(0)\n  %f = f32[4]{0} fusion(%p), kind=kLoop\n"
        ...               "  ROOT %c = f32[4]{0} copy(%f)\n}\n")
        2
    """
    m = re.search(r"^ENTRY\b[^\n]*\{\n(.*?)^\}", hlo_text, re.S | re.M)
    if not m:
        raise ValueError("no ENTRY computation in the HLO text")
    n = 0
    for line in m.group(1).splitlines():
        op = _INSTR_RE.match(line)
        if op and op.group(1) not in _NOT_KERNELS and not op.group(1).endswith("-done"):
            n += 1
    return n


# ----------------------------------------------------------------------------- cache + worker

def _jax_version() -> str:
    try:
        return importlib.metadata.version("jax") + "/" + importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshpipe" / "planner"


@dataclass
class ProfileStats:
    """What one `Profiler.profile` call did: hits, compiles, wall time in the worker."""

    requested: int = 0
    cache_hits: int = 0
    compiled: int = 0
    compile_s: float = 0.0
    worker_s: float = 0.0


@dataclass
class Profiler:
    """Profiles layers in a subprocess, through a JSON cache on disk.

    Attributes:
      worker: the module run as `python -m <worker>` (reads the request JSON on stdin,
        writes one JSON line per profile on stdout); the driver passes `stages.aot_profile`.
      cache_dir: where profiles are kept (None: no cache).
      timeout_s: deadline for one worker run.
      python: the interpreter for the worker (default: this one).
    """

    worker: str
    cache_dir: Path | None = None
    timeout_s: float = 900.0
    python: str = sys.executable
    stats: ProfileStats = field(default_factory=ProfileStats)

    def _key(self, source: Mapping[str, Any], r: ProfileRequest) -> str:
        payload = {"protocol": PROTOCOL, "worker": self.worker, "jax": _jax_version(), "source": source,
                   "signature": r.signature, "model_size": r.model_size, "rules": r.rules, "batch": r.batch}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _read(self, key: str) -> LayerProfile | None:
        if self.cache_dir is None:
            return None
        path = Path(self.cache_dir) / f"{key}.json"
        try:
            return LayerProfile.from_json(json.loads(path.read_text()), cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write(self, key: str, prof: LayerProfile) -> None:
        if self.cache_dir is None:
            return
        d = Path(self.cache_dir)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(prof.to_json()))
        os.replace(tmp, d / f"{key}.json")

    def profile(self, source: Mapping[str, Any], requests: Sequence[ProfileRequest]) -> dict[ProfileRequest, LayerProfile]:
        """Profiles for every request (cache first, then one worker run for the rest)."""
        out: dict[ProfileRequest, LayerProfile] = {}
        todo: dict[str, ProfileRequest] = {}
        same: dict[str, list[ProfileRequest]] = {}
        for r in dict.fromkeys(requests):
            self.stats.requested += 1
            key = self._key(source, r)
            if key in same:              # an equal layer (same signature) already asked for
                same[key].append(r)
                continue
            same[key] = [r]
            hit = self._read(key)
            if hit is not None:
                self.stats.cache_hits += 1
            else:
                todo[key] = r
            out[r] = hit
        if todo:
            done, error = self._run(source, todo)
            for key, prof in done.items():      # keep what compiled, even when a later program failed
                self._write(key, prof)
                out[todo[key]] = prof
                self.stats.compiled += 1
                self.stats.compile_s += prof.compile_s
            if error:
                raise ProfileError(error)
        for key, rs in same.items():
            for r in rs[1:]:
                out[r] = out[rs[0]]
        return out

    def _run(self, source: Mapping[str, Any], todo: Mapping[str, ProfileRequest]) -> tuple[dict, str]:
        """({key: profile} for what the worker finished, an error message or "")."""
        devices = max(r.model_size for r in todo.values())
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
        # the worker imports the same checkout as this process (not whatever is installed)
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        request = {"protocol": PROTOCOL, "source": dict(source),
                   "requests": [dict(r.to_json(), key=k) for k, r in todo.items()]}
        t0 = time.perf_counter()
        timed_out = False
        try:
            proc = subprocess.run([self.python, "-m", self.worker], input=json.dumps(request), text=True,
                                  capture_output=True, env=env, timeout=self.timeout_s)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            timed_out = True
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = None
        finally:
            self.stats.worker_s += time.perf_counter() - t0
        results, failures = {}, []
        for line in stdout.splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except ValueError:          # a line cut short by the timeout
                continue
            if "profile" in d and d.get("key") in todo:
                results[d["key"]] = LayerProfile.from_json(d["profile"])
            elif "error" in d and d.get("key") in todo:
                failures.append((todo[d["key"]], d["error"]))
        if timed_out:
            return results, (f"profiling worker {self.worker} ran past {self.timeout_s:g} s; {len(results)} of "
                             f"{len(todo)} layer programs done (kept in the cache); run again to continue, "
                             "or narrow the search (--max-model, --microbatches)")
        if failures:
            r, why = failures[0]
            return results, (f"profiling worker {self.worker} could not compile layer {r.layer} on model={r.model_size} "
                             f"rules {dict(r.rules)} batch {r.batch}: {why}"
                             + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        if rc != 0 or set(results) != set(todo):
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            return results, (f"profiling worker {self.worker} exited with {rc} after {len(results)}/{len(todo)} "
                             f"layer programs:\n{tail}")
        return results, ""
