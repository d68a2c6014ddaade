"""Security defaults: what meshpipe exposes, writes and reads back.

  - An embedded Ray (cluster `address: null`) listens on 127.0.0.1 only — every
    Ray server, not just the dashboard — unless the cluster YAML says otherwise,
    and then a warning says what is exposed. Ray's token auth is left alone.
  - Secrets (keys like `HF_TOKEN`, `api_key`; token-shaped strings) are redacted
    in error messages and summary.json; `env_vars` reach the actors intact.
  - Nothing in the package unpickles or evals what it reads (source scan).
  - Run directories are 0o700 and summary.json is 0o600, whatever the umask.
See docs/security.md.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.config import (ConfigError, check_job, check_output_dir, load_cluster, load_job,
                                 parse_cluster, parse_job)
from orchestrator.core.private_fs import private_dir, write_private
from orchestrator.core.redact import REDACTED, is_secret_key, looks_like_token, redact, redact_text
from tests.conftest import ROOT

GPT = ROOT / "examples" / "gpt.yaml"
LOCAL = ROOT / "cluster_configs" / "local.yaml"
GH_TOKEN = "ghp_" + "Ab3" * 12
RAY_TOKEN = "0123456789abcdef" * 4          # the shape of Ray's own auth token (token_hex(32))
LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def tiny_job(output_dir: Path, name: str = "sec") -> dict:
    return {"run": {"name": name, "steps": 1, "output_dir": str(output_dir)},
            "model": {"name": "mlp", "args": {"blocks": 0, "d_in": 4, "d_model": 8, "d_mlp": 8, "d_out": 2}},
            "data": {"global_batch": 4}, "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
            "pipeline": {"schedule": "gpipe", "microbatches": 2,
                         "stages": [{"layers": [0, 1], "mesh": {"data": 1}}, {"layers": [1, 2], "mesh": {"data": 1}}]}}


# ----------------------------------------------------------------------------- network exposure

PROBE = r"""
import json, os, sys
import ray
try:
    import psutil  # Ray ships it (ray/thirdparty_files) and puts it on sys.path
except ImportError:
    print(json.dumps({"skip": "psutil is not importable"}))
    sys.exit(0)
from orchestrator.driver import placement
from orchestrator.core.config import parse_cluster

cluster = parse_cluster(json.loads(sys.argv[1]))
var = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
before = os.environ.get(var)
assert placement.connect(cluster, "meshpipe-security-probe")

@ray.remote(num_cpus=0)
def ping():
    return 1

ray.get(ping.remote(), timeout=120)          # a worker process exists too
me = psutil.Process()
pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
listen = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids})
print(json.dumps({
    "listen": listen,
    "dashboard_url": ray._private.worker.get_dashboard_url(),
    "gcs_address": ray.get_runtime_context().gcs_address,
    "node_ip": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]],
    "env_restored": os.environ.get(var) == before,
    "auth_mode": os.environ.get("RAY_AUTH_MODE"),
}))
ray.shutdown()
"""


def probe(cluster: dict) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cluster)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in info:
        pytest.skip(info["skip"])
    return info, out.stderr


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


@pytest.mark.ray
def test_embedded_ray_listens_on_loopback_only():
    """meshpipe's embedded Ray: dashboard, GCS, raylet, agents and workers all bind 127.0.0.1."""
    info, stderr = probe({"hosts": 1, "devices_per_host": 1, "num_cpus": 2})
    assert len(info["listen"]) >= 4, info  # GCS, raylet, dashboard, agents, worker...
    exposed = [f"{ip}:{port}" for ip, port in info["listen"] if ip not in LOOPBACK_IPS]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert host_of(info["dashboard_url"]) == "127.0.0.1"
    assert host_of(info["gcs_address"]) == "127.0.0.1"
    assert info["node_ip"] == ["127.0.0.1"]
    assert info["env_restored"]  # the switch does not leak into later ray.init calls of this process
    assert info["auth_mode"] != "disabled"  # token auth left as Ray sets it
    assert "listens on" not in stderr  # nothing exposed, nothing to warn about


class _FakeContext:
    dashboard_url = "0.0.0.0:8265"
    address_info = {"gcs_address": "10.1.2.3:6379"}


@pytest.fixture
def fake_ray_init(monkeypatch):
    """ray.init replaced by a recorder: what connect() asks Ray for, without starting Ray."""
    import ray
    from ray._private import ray_constants

    calls = []

    def init(**kwargs):
        calls.append({"kwargs": kwargs, "env": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
                      "const": ray_constants.ENABLE_RAY_CLUSTER})
        return _FakeContext()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    return calls


def test_connect_default_is_loopback_and_quiet(fake_ray_init, caplog):
    from ray._private import ray_constants

    from orchestrator.driver import placement

    const = ray_constants.ENABLE_RAY_CLUSTER
    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        assert placement.connect(parse_cluster({"hosts": 1, "devices_per_host": 1}), "ns")
    (call,) = fake_ray_init
    assert call["kwargs"]["dashboard_host"] == "127.0.0.1" and "_node_ip_address" not in call["kwargs"]
    assert call["env"] == "0" and call["const"] is False  # Ray's single-machine mode while it starts
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and ray_constants.ENABLE_RAY_CLUSTER == const
    assert not [r for r in caplog.records if r.name == "meshpipe"]


def test_connect_warns_about_what_the_yaml_exposes(fake_ray_init, caplog):
    from orchestrator.driver import placement

    cluster = parse_cluster({"hosts": 1, "devices_per_host": 1, "dashboard_host": "0.0.0.0",
                             "node_ip_address": "10.1.2.3"})
    with caplog.at_level(logging.WARNING, logger="meshpipe"):
        placement.connect(cluster, "ns")
    (call,) = fake_ray_init
    assert call["kwargs"]["_node_ip_address"] == "10.1.2.3" and call["env"] is None
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "meshpipe")
    for needle in ("dashboard listens on 0.0.0.0:8265", "cluster.dashboard_host = 0.0.0.0", "job submission",
                   "all interfaces", "cluster.node_ip_address = 10.1.2.3", "GCS at 10.1.2.3:6379",
                   "token authentication"):
        assert needle in text, text


def test_wildcard_node_ip_refused():
    with pytest.raises(ConfigError, match="node_ip_address = '0.0.0.0': .*not a wildcard"):
        parse_cluster({"hosts": 1, "devices_per_host": 1, "node_ip_address": "0.0.0.0"})


def auth_mode_writes(source: str, name: str = "<src>") -> list[str]:
    """Places that set RAY_AUTH_MODE (env item, setdefault/putenv, dict/keyword) to anything but 'token'."""
    def is_key(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == "RAY_AUTH_MODE"

    def token(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == "token"

    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and is_key(t.slice) for t in targets) and not token(node.value):
                found.append(f"{where}: [RAY_AUTH_MODE] = ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("setdefault", "putenv", "__setitem__") \
                    and node.args and is_key(node.args[0]) and not (len(node.args) > 1 and token(node.args[1])):
                found.append(f"{where}: {fn.attr}(RAY_AUTH_MODE, ...)")
            if any(k.arg == "RAY_AUTH_MODE" and not token(k.value) for k in node.keywords):
                found.append(f"{where}: RAY_AUTH_MODE=...")
        elif isinstance(node, ast.Dict):
            if any(is_key(k) and not token(v) for k, v in zip(node.keys, node.values)):
                found.append(f"{where}: {{'RAY_AUTH_MODE': ...}}")
    return found


def test_meshpipe_never_turns_ray_auth_off():
    """Token auth is Ray's to set: no source sets RAY_AUTH_MODE to anything but 'token'."""
    bad = ("import os\nos.environ['RAY_AUTH_MODE'] = 'disabled'\nos.environ.setdefault('RAY_AUTH_MODE', 'x')\n"
           "env = {**os.environ, 'RAY_AUTH_MODE': 'disabled'}\ndict(RAY_AUTH_MODE='disabled')\n")
    assert len(auth_mode_writes(bad)) == 4
    assert not auth_mode_writes("import os\nmode = os.environ.get('RAY_AUTH_MODE')\n"
                                "os.environ['RAY_AUTH_MODE'] = 'token'\n")
    found = [hit for p in package_sources() for hit in auth_mode_writes(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, found


# ----------------------------------------------------------------------------- redaction

@pytest.mark.parametrize("key", ["HF_TOKEN", "api_key", "apiKey", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY",
                                 "db_password", "passwd", "client-secret", "auth", "RAY_AUTH_TOKEN",
                                 "credentials", "private_key", "key", "token", "Authorization"])
def test_secret_keys(key):
    assert is_secret_key(key)
    assert redact({key: "v"}) == {key: REDACTED}


@pytest.mark.parametrize("key", ["key_size", "num_tokens", "tokenizer", "author", "d_model", "batch",
                                 "NCCL_DEBUG", "learning_rate", "keys", "mesh", "XLA_FLAGS", "monkey"])
def test_ordinary_keys_kept(key):
    assert not is_secret_key(key)
    assert redact({key: "v"}) == {key: "v"}


@pytest.mark.parametrize("value", [GH_TOKEN, "hf_" + "a1B2" * 8, "sk-ant-" + "x" * 30, "AKIA" + "ABCDEFGHIJKLMNOP",
                                   "xoxb-1234567890-abcdef", RAY_TOKEN, "eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.sig",
                                   "Bearer abcdefghijklmnop", "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA "
                                   "PRIVATE KEY-----", "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY"])
def test_token_shapes_redacted_anywhere(value):
    assert looks_like_token(value)
    (out,) = redact({"notes": [value]})["notes"]
    assert value not in out and REDACTED in out
    assert value not in redact_text(f"value {value!r} is bad") and REDACTED in redact_text(f"x {value} y")


@pytest.mark.parametrize("value", ["runs/gpt-tiny", "/home/Alice/Work2/meshpipe/examples/data/tiny.txt",
                                   "batch:data;mlp:model", "interleaved-1f1b", "0123abcd" * 5, "adam", "3e-3"])
def test_ordinary_values_kept(value):
    assert not looks_like_token(value)
    assert redact(value) == value and redact_text(value) == value


def test_redact_text_forms():
    assert redact_text("override 'model.args.api_key=hunter2': unknown") == \
        f"override 'model.args.api_key={REDACTED}': unknown"
    assert redact_text("{'password': 'a b', 'lr': 1}") == f"{{'password': '{REDACTED}', 'lr': 1}}"
    assert redact_text("postgres://bob:hunter2@db:5432/x") == f"postgres://bob:{REDACTED}@db:5432/x"
    assert redact_text("x.api_token: unknown key; valid keys: name") == "x.api_token: unknown key; valid keys: name"


def test_config_errors_never_echo_secrets(tmp_path):
    cases = [
        (parse_cluster, {"hosts": 1, "devices_per_host": 1, "env_vars": {"HF_TOKEN": ["hunter2"]}},
         ["env_vars.HF_TOKEN", "must be a string"]),
        (parse_cluster, {"hosts": 1, "devices_per_host": 1, "env_vars": {"1BAD": GH_TOKEN}},
         ["env_vars.1BAD", "environment variable name"]),
        (parse_cluster, {"hosts": 1, "devices_per_host": 1, "api_token": "hunter2"},
         ["api_token: unknown key"]),
        (parse_cluster, {"hosts": 1, "devices_per_host": 1, "timeouts": {"password": RAY_TOKEN}},
         ["timeouts.password: unknown key"]),
    ]
    for fn, raw, needles in cases:
        with pytest.raises(ConfigError) as ei:
            fn(raw)
        msg = str(ei.value)
        assert all(n in msg for n in needles), msg
        assert "hunter2" not in msg and GH_TOKEN not in msg and RAY_TOKEN not in msg and REDACTED in msg, msg
    for overrides in (["model.args.api_key=hunter2"], [f"data.path={GH_TOKEN}"], ["run.password.x=hunter2"],
                      ["optimizer.args={learning_rate: 0.1, token: hunter2}"]):
        with pytest.raises(ConfigError) as ei:
            check_job(load_job(GPT, overrides), load_cluster(LOCAL))
        msg = str(ei.value)
        assert "hunter2" not in msg and GH_TOKEN not in msg, msg


def test_cluster_repr_hides_env_values():
    c = parse_cluster({"hosts": 1, "devices_per_host": 1, "env_vars": {"HF_TOKEN": "hunter2", "N": 1}})
    assert c.env_vars == {"HF_TOKEN": "hunter2", "N": "1"}  # the real values, for the actors
    assert "hunter2" not in repr(c) and "hunter2" not in str(c)
    with pytest.raises(ConfigError, match="XLA_FLAGS is set by meshpipe"):
        parse_cluster({"hosts": 1, "devices_per_host": 1, "env_vars": {"XLA_FLAGS": "--x"}})


def test_checked_summary_is_redacted_but_configs_round_trip():
    cluster = parse_cluster({"hosts": 2, "devices_per_host": 1, "num_cpus": 2,
                             "env_vars": {"HF_TOKEN": "hunter2", "NCCL_DEBUG": "INFO"}})
    checked = check_job(parse_job(tiny_job(Path("runs"))), cluster)
    assert checked.to_dict()["cluster"]["env_vars"] == {"HF_TOKEN": REDACTED, "NCCL_DEBUG": "INFO"}
    assert "hunter2" not in checked.to_json()
    assert parse_cluster(cluster.to_dict()) == cluster  # the config itself keeps the real value


def test_env_vars_reach_the_actor_runtime_env(monkeypatch):
    from orchestrator.driver import placement

    monkeypatch.setattr(placement, "_bundle_addresses", lambda pg, hosts: {})
    env_vars = {"HF_TOKEN": "hunter2", "NCCL_DEBUG": "INFO"}
    checked = check_job(parse_job(tiny_job(Path("runs"))),
                        parse_cluster({"address": "auto", "hosts": 2, "devices_per_host": 1, "env_vars": env_vars}))
    opts = placement.actor_options(checked, checked.stages[1], 0, None, "sec")
    env = opts["runtime_env"]["env_vars"]
    assert env["HF_TOKEN"] == "hunter2" and env["NCCL_DEBUG"] == "INFO" and "XLA_FLAGS" in env


def test_summary_is_redacted_and_owner_only(tmp_path):
    """A reference run under umask 0: secrets absent from summary.json, dir 0o700, file 0o600."""
    from orchestrator.driver.runner import run_job

    cluster = parse_cluster({"hosts": 2, "devices_per_host": 1, "num_cpus": 2,
                             "env_vars": {"HF_TOKEN": "hunter2", "NOTES": GH_TOKEN, "NCCL_DEBUG": "INFO"}})
    checked = check_job(parse_job(tiny_job(tmp_path / "out")), cluster)
    old = os.umask(0)
    try:
        run_job(checked, reference=True, echo=lambda s: None)
    finally:
        os.umask(old)
    from tests.records import run_dir as latest_run

    run_dir = latest_run(tmp_path / "out", "sec")
    (summary,) = run_dir.glob("summary*.json")
    text = summary.read_text()
    assert "hunter2" not in text and GH_TOKEN not in text
    env = json.loads(json.loads(text)["config"])["cluster"]["env_vars"]
    assert env == {"HF_TOKEN": REDACTED, "NOTES": REDACTED, "NCCL_DEBUG": "INFO"}
    assert mode(run_dir) == 0o700 and mode(run_dir.parent) == 0o700 and mode(tmp_path / "out") == 0o700
    assert mode(summary) == 0o600
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- nothing unpickled

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
UNSAFE_YAML = {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all", "Loader", "UnsafeLoader",
               "FullLoader", "UnsafeConstructor", "FullConstructor"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "SafeConfigLoader"}


def package_sources() -> list[Path]:
    return sorted(p for d in ("orchestrator", "stages") for p in (ROOT / d).rglob("*.py"))


def unsafe_reads(source: str, name: str = "<src>") -> list[str]:
    """Every place in `source` that could turn bytes read back into code or objects."""
    found = []
    tree = ast.parse(source, name)
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[-1] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[-1] in BANNED_MODULES or any(a.name in BANNED_MODULES for a in node.names):
                found.append(f"{where}: from {mod} import ...")
            if mod == "yaml" and any(a.name in UNSAFE_YAML | {"load", "load_all"} for a in node.names):
                found.append(f"{where}: from yaml import unsafe loader")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base, attr = node.value.id, node.attr
            if base == "yaml" and attr in UNSAFE_YAML:
                found.append(f"{where}: yaml.{attr}")
            if base in BANNED_MODULES or attr in ("cloudpickle", "read_pickle"):
                found.append(f"{where}: {base}.{attr}")
            if base == "torch" and attr == "load":
                found.append(f"{where}: torch.load")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in ("eval", "exec", "__import__"):
                found.append(f"{where}: {fn.id}(...)")
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "yaml" \
                    and fn.attr in ("load", "load_all"):
                loader = next((k.value for k in node.keywords if k.arg == "Loader"),
                              node.args[1] if len(node.args) > 1 else None)
                ok = isinstance(loader, (ast.Name, ast.Attribute)) and \
                    (loader.id if isinstance(loader, ast.Name) else loader.attr) in SAFE_LOADERS
                if not ok:
                    found.append(f"{where}: yaml.{fn.attr} without SafeLoader")
            if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in node.keywords):
                found.append(f"{where}: allow_pickle")
    for i, line in enumerate(source.splitlines(), 1):  # plain grep too, for what the AST cannot see
        # a method of that name (nnx's `module.eval()`, train/eval mode) or a name in backticks is not the builtin
        if re.search(r"\b(cloud)?pickle\.loads?\(|yaml\.unsafe_load|(?<![\w.`])(eval|exec)\(", line):
            found.append(f"{name}:{i}: {line.strip()}")
    return found


def test_scanner_catches_each_pattern():
    bad = ("import pickle\nfrom ray import cloudpickle\nimport yaml, numpy as np\n"
           "pickle.loads(b'')\nyaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\nyaml.unsafe_load(s)\n"
           "eval('1')\nexec('x=1')\nnp.load('f.npy', allow_pickle=True)\n")
    found = "\n".join(unsafe_reads(bad))
    for needle in ("import pickle", "from ray import", "pickle.loads", "yaml.load without SafeLoader",
                   "yaml.Loader", "yaml.unsafe_load", "eval(", "exec(", "allow_pickle"):
        assert needle in found, (needle, found)
    assert not unsafe_reads("import yaml\nyaml.load(s, Loader=yaml.SafeLoader)\nyaml.safe_load(s)\n"
                            "np.load('f.npy', allow_pickle=False)\nmod.eval()\n# put in `eval()` mode\n")
    assert unsafe_reads("x = (eval)('1')\n") and unsafe_reads("f(exec('x=1'))\n")


def test_package_never_unpickles_or_evals():
    sources = package_sources()
    assert len(sources) > 20 and any(p.name == "safe_yaml.py" for p in sources)
    found = [hit for p in sources for hit in unsafe_reads(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------- file permissions

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o002])
def test_private_dirs_and_files_ignore_umask(tmp_path, umask):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    old = os.umask(umask)
    try:
        d = private_dir(shared / "a" / "b" / "run")
        f = write_private(d / "summary.json", "{}")
        write_private(f, "{ }")  # rewriting keeps it private
    finally:
        os.umask(old)
    assert [mode(p) for p in (shared / "a", shared / "a" / "b", d)] == [0o700] * 3
    assert mode(f) == 0o600 and f.read_text() == "{ }"
    assert mode(shared) == 0o755  # an existing parent is not touched


def test_existing_run_dir_is_tightened_but_shared_parents_are_not(tmp_path):
    from orchestrator.driver.rundir import open_run

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    (shared / "sec").mkdir()
    os.chmod(shared / "sec", 0o755)
    checked = check_job(parse_job(tiny_job(shared)), parse_cluster({"hosts": 2, "devices_per_host": 1,
                                                                     "num_cpus": 2}))
    assert check_output_dir(checked.job) == shared / "sec"
    run = open_run(checked.job)
    assert run.parent == shared / "sec" and mode(run) == 0o700
    assert mode(shared / "sec") == 0o700 and mode(shared) == 0o755


def test_check_output_dir_creates_owner_only_dirs(tmp_path):
    old = os.umask(0)
    try:
        job = load_job(GPT, [f"run.output_dir={tmp_path / 'x' / 'runs'}"])
        check_output_dir(job)
    finally:
        os.umask(old)
    assert mode(tmp_path / "x") == 0o700 and mode(tmp_path / "x" / "runs") == 0o700


@pytest.mark.parametrize("module", ["orchestrator.core.redact", "orchestrator.core.private_fs"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("address,sent,warned", [
    ("http://10.0.0.5:8265", True, True), ("10.0.0.5:8265", True, True), ("https://10.0.0.5:8265", True, False),
    ("http://127.0.0.1:8265", True, False), ("http://localhost:8265", True, False),
    ("http://10.0.0.5:8265", False, False)])
def test_submit_warns_before_the_token_goes_over_plain_http(address, sent, warned):
    from orchestrator.driver import jobs

    msg = jobs.cleartext_token_warning(address, sent)
    assert (msg is not None) == warned
    if warned:
        assert "plain http" in msg and "10.0.0.5" in msg and RAY_TOKEN not in msg
        # In a child process: Ray's token loader caches the first token it reads for the whole
        # process, so a fake token loaded here would break every later Ray start in this session.
        code = ("import logging, sys\n"
                "logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
                "from orchestrator.driver import jobs\n"
                "try:\n"
                "    jobs.client('http://meshpipe-no-such-host.invalid:8265')   # fails at once, after warning\n"
                "except jobs.JobsError:\n"
                "    pass\n")
        env = {**os.environ, "RAY_AUTH_TOKEN": RAY_TOKEN}
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
        assert "goes to meshpipe-no-such-host.invalid over plain http" in r.stderr, r.stderr
        assert RAY_TOKEN not in r.stderr + r.stdout
