"""TLS on the socket transport's TCP links (cluster `transport_tls`, `orchestrator.core.tls`).

Pure sockets and real listeners in this process (fast): the files are checked with their key
named (missing, a key that is not the certificate's, a foreign CA, an expired certificate, a
passphrase); tensors cross a TLS link exactly; a plaintext connector, one whose certificate
another CA signed and one without the run key are each refused by a TLS listener with the
reason logged. On a local Ray (`slow`): a 2-stage GPT over TCP + TLS trains exactly as over
plain TCP while a plaintext and a foreign-certificate client knock on every listener.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, parse_cluster
from orchestrator.core.tls import check_files, check_transport_tls, contexts
from stages.frames import HELLO, HELLO_MAGIC, HandshakeRefused, encode_frame
from stages.mailbox import Mailbox
from stages.socket_conn import Listener, _Conn
from benchmarks.tls_certs import make_tls as _make_tls

TOKEN = b"t" * 32


def make_tls(directory, expired: bool = False) -> dict[str, str]:
    """`benchmarks.tls_certs.make_tls`; the test skips where the `cryptography` package is missing."""
    pytest.importorskip("cryptography")
    return _make_tls(directory, expired)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """This cluster's CA and node certificate, and a stranger's (another CA)."""
    root = tmp_path_factory.mktemp("pki")
    return make_tls(root / "ours"), make_tls(root / "theirs")


def test_cluster_keys_are_validated_by_name():
    tls = {"cert_file": "/etc/meshpipe/node.pem", "key_file": "/etc/meshpipe/node.key", "ca_file": "/etc/meshpipe/ca.pem"}
    c = parse_cluster({"hosts": 2, "devices_per_host": 1, "transport_tls": tls, "transport_same_machine": "tcp"})
    assert c.transport_tls.model_dump() == tls and parse_cluster(c.to_dict()) == c
    assert parse_cluster({"hosts": 1, "devices_per_host": 1}).transport_tls is None
    for extra, words in [
        ({"transport_tls": {**tls, "cert_file": "node.pem"}}, ["transport_tls.cert_file", "'node.pem'", "absolute path"]),
        ({"transport_tls": {k: v for k, v in tls.items() if k != "ca_file"}}, ["transport_tls.ca_file", "missing"]),
        ({"transport_tls": {**tls, "verify": False}}, ["transport_tls.verify", "unknown key"]),
        ({"transport": "ray", "transport_tls": tls}, ["transport_tls", "only for transport: socket"]),
        ({"transport": "ray", "transport_same_machine": "tcp"}, ["transport_same_machine", "only for transport: socket"]),
        ({"transport_same_machine": "shm"}, ["transport_same_machine", "'shm'", "'unix', 'tcp'"]),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_cluster({"hosts": 2, "devices_per_host": 1, **extra})
        assert all(w in str(err.value) for w in words), (words, str(err.value))


def test_files_are_checked_before_anything_starts_naming_the_key(pki, tmp_path):
    ours, theirs = pki
    assert check_files(ours) == []
    missing = {**ours, "ca_file": str(tmp_path / "nope.pem")}
    assert check_files(missing) == [("transport_tls.ca_file", missing["ca_file"], "file not found")]
    assert check_files({**ours, "cert_file": str(tmp_path)})[0][:2] == ("transport_tls.cert_file", str(tmp_path))
    (key, value, rule), = check_files({**ours, "key_file": theirs["key_file"]})
    assert (key, value) == ("transport_tls.key_file", theirs["key_file"]) and "KEY_VALUES_MISMATCH" in rule
    (key, value, rule), = check_files({**ours, "ca_file": theirs["ca_file"]})     # a certificate that CA did not sign
    assert key == "transport_tls.cert_file" and "handshake" in rule and "signed by that CA" in rule
    (key, _, rule), = check_files(make_tls(tmp_path / "old", expired=True))
    assert key == "transport_tls.cert_file" and "expired" in rule
    (key, _, rule), = check_files({**ours, "ca_file": ours["key_file"]})
    assert key == "transport_tls.ca_file" and "PEM CA" in rule

    from cryptography.hazmat.primitives import serialization

    pem = Path(ours["key_file"]).read_bytes()
    locked = serialization.load_pem_private_key(pem, None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw"))
    (tmp_path / "locked.key").write_bytes(locked)
    (key, _, rule), = check_files({**ours, "key_file": str(tmp_path / "locked.key")})
    assert key == "transport_tls.key_file" and "passphrase" in rule

    cluster = parse_cluster({"hosts": 2, "devices_per_host": 1, "transport_tls": missing})
    with pytest.raises(ConfigError, match=r"cluster\.transport_tls\.ca_file = '.*nope\.pem': file not found"):
        check_transport_tls(cluster)
    check_transport_tls(parse_cluster({"hosts": 2, "devices_per_host": 1, "transport_tls": ours}))


@pytest.fixture
def tls_listener(pki):
    server, _ = contexts(pki[0])
    box, errors = Mailbox("tls"), []
    lst = Listener("127.0.0.1", TOKEN, lambda frame, conn: box.put(frame.key, frame.arrays), errors.append,
                   io_timeout=10, name="tls listener", tls=server)      # (the default 5 s handshake deadline)
    lst.box, lst.errors = box, errors
    yield lst
    lst.close()


def test_tensors_cross_a_tls_link_exactly(pki, tls_listener):
    _, client = contexts(pki[0])
    conn = _Conn(tls_listener.address, TOKEN, io_timeout=5, tls=client)
    try:
        assert isinstance(conn.sock, ssl.SSLSocket) and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
        rng = np.random.default_rng(0)
        big = rng.standard_normal((300, 257)).astype(np.float32)        # > one TLS record, odd row length
        arrays = [big, big[:, 3:200:2], np.arange(5, dtype=np.int8), np.float16(1.5) * np.ones((0, 3), np.float16)]
        conn.send(encode_frame((0, "F", 1, 0, 0), arrays))
        got = tls_listener.box.take((0, "F", 1, 0, 0), timeout=30)
        for a, b in zip(arrays, got, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        assert tls_listener.refused == 0 and not tls_listener.errors
    finally:
        conn.close()


def _plain_hello(address) -> socket.socket:
    s = socket.create_connection(address, timeout=5)
    s.sendall(HELLO.pack(HELLO_MAGIC, b"n" * 32))
    return s


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_a_tls_listener_refuses_plaintext_strangers_and_a_wrong_key_with_a_logged_reason(pki, tls_listener, caplog):
    ours, theirs = pki
    caplog.set_level(logging.WARNING, logger="stages.socket_conn")
    plain = _plain_hello(tls_listener.address)                        # the plaintext handshake
    assert _closed_within(plain, 10), "a plaintext connector was not dropped"
    plain.close()

    def reasons():
        return [r.getMessage() for r in caplog.records if "dropped an unauthenticated connection" in r.getMessage()]

    def kinds():
        return [k for r in reasons() for k in ("WRONG_VERSION_NUMBER", "CERTIFICATE_VERIFY_FAILED",
                                               "closed during the handshake") if k in r]

    def logged(kind: str) -> None:          # (the listener logs on its own thread, in its own order)
        deadline = time.monotonic() + 15
        while kind not in kinds() and time.monotonic() < deadline:
            time.sleep(0.05)

    _, client = contexts(ours)                                        # our CA, but not this run's key
    with pytest.raises(HandshakeRefused):
        _Conn(tls_listener.address, b"x" * 32, io_timeout=3, tls=client)
    # the listener logs only its first 5 refusals, and the stranger below may try several times:
    # this one is logged before the stranger starts
    logged("closed during the handshake")
    _, stranger = contexts({**theirs, "ca_file": ours["ca_file"]})   # trusts us, but another CA signed its cert
    with pytest.raises((ssl.SSLError, ConnectionError)):
        c = _Conn(tls_listener.address, TOKEN, io_timeout=3, tls=stranger)
        c.close()
    logged("CERTIFICATE_VERIFY_FAILED")
    got = kinds()
    # plaintext: OpenSSL's reason; the stranger: its certificate (it may try again while its io_timeout
    # lasts: an EOF mid-handshake is worth a retry); no run key: the connector found us out first
    assert (got.count("WRONG_VERSION_NUMBER"), got.count("closed during the handshake")) == (1, 1), reasons()
    assert got.count("CERTIFICATE_VERIFY_FAILED") >= 1, reasons()
    assert len(got) == len(reasons()) == min(tls_listener.refused, 5), (reasons(), tls_listener.refused)
    ok = _Conn(tls_listener.address, TOKEN, io_timeout=3, tls=client)  # and a genuine peer still gets in
    ok.send(encode_frame((7,), [np.ones(3, np.float32)]))
    np.testing.assert_array_equal(tls_listener.box.take((7,), timeout=30)[0], np.ones(3, np.float32))
    ok.close()
    assert not tls_listener.errors


# -- on a local Ray -------------------------------------------------------------------
class Knocker:
    """During a run: finds every stage actor's TCP listener and knocks once with a plaintext
    HELLO and once over TLS with a certificate another CA signed (trusting the cluster's CA, so
    the listener is the one to refuse); records whether each was dropped."""

    def __init__(self, stranger: ssl.SSLContext, actors: int):
        self.stranger, self.actors = stranger, actors
        self.results: list[tuple[str, tuple, bool]] = []
        self.error: str | None = None
        self.stop = threading.Event()

    def _addresses(self):
        import ray

        names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "/stage" in a["name"]]
        if len(names) < self.actors:
            return None
        out = []
        for a in names:
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            try:
                addr = ray.get(handle.transport_address.options(concurrency_group="io").remote(), timeout=60)
            except ray.exceptions.RayTaskError:
                return None
            if addr is None:
                return None
            out.append(tuple(addr[:2]))
        return out

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                found = self._addresses()
                if found:
                    break
                time.sleep(0.2)
            else:
                return
            for address in found:
                s = _plain_hello(address)
                self.results.append(("plaintext", address, _closed_within(s, 10)))
                s.close()
                raw = socket.create_connection(address, timeout=10)
                try:
                    with self.stranger.wrap_socket(raw) as t:
                        t.sendall(HELLO.pack(HELLO_MAGIC, b"n" * 32))
                        self.results.append(("foreign certificate", address, _closed_within(t, 10)))
                except (ssl.SSLError, ConnectionError):
                    self.results.append(("foreign certificate", address, True))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = f"{type(e).__name__}: {e}"


def _steady(times: list[float]) -> float:
    return float(np.median(times[1:]))     # the first step compiles


@pytest.mark.ray
@pytest.mark.slow
def test_a_tls_run_trains_as_the_plain_tcp_run_while_strangers_are_refused(pki, tmp_path, no_leaks):
    from orchestrator.core.config import check_job, parse_job
    from orchestrator.driver.runner import run_job
    from tests.test_pipeline_numerics import CLUSTER, assert_same_training, gpt_job

    ours, theirs = pki
    tcp = {**CLUSTER, "transport_same_machine": "tcp"}      # one machine: force the TCP links
    plain = run_job(check_job(parse_job(gpt_job(tmp_path / "plain", steps=8)), parse_cluster(tcp)), echo=lambda s: None)
    knock = Knocker(contexts({**theirs, "ca_file": ours["ca_file"]})[1], actors=2)
    knocker = threading.Thread(target=knock.run, daemon=True)
    knocker.start()
    try:
        secure = run_job(check_job(parse_job(gpt_job(tmp_path / "tls", steps=8)),
                                   parse_cluster({**tcp, "transport_tls": ours})), echo=lambda s: None)
    finally:
        knock.stop.set()
        knocker.join(60)
    ref = run_job(check_job(parse_job(gpt_job(tmp_path / "ref", steps=8)), parse_cluster(tcp)),
                  reference=True, echo=lambda s: None)
    assert_same_training(secure, ref)                   # the single-process oracle, rtol 1e-5 / atol 1e-6
    assert secure["losses"] == plain["losses"]          # and exactly the plain run: the same bytes arrived
    assert secure["param_norms"] == plain["param_norms"]
    assert {w["transport_tls"] for w in secure["workers"]} == {True}
    assert {w["transport_tls"] for w in plain["workers"]} == {False}
    assert knock.error is None, knock.error
    assert len(knock.results) == 4 and all(dropped for _, _, dropped in knock.results), knock.results
    print(f"tiny 2-stage GPT over TCP, median step {_steady(plain['step_times_s']) * 1e3:.1f} ms plain, "
          f"{_steady(secure['step_times_s']) * 1e3:.1f} ms TLS")
