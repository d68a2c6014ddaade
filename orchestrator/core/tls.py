"""TLS for the socket transport's TCP links (cluster `transport_tls`), with the standard `ssl` module.

Both ends of a TCP link authenticate each other against the cluster's own CA: the listener and
the connector each present `cert_file` + `key_file` and require the peer's certificate to chain
up to `ca_file` (TLS 1.2 at least; 1.3 where both ends have it). Host names are not checked:
stage actors reach each other by node IP, so the CA must be one made for this cluster (any
certificate it signed is a peer). The transport's HMAC challenge-response over the run key still
runs inside the encrypted channel. Same-machine links (abstract Unix socket + shared memory) are
never wrapped: they do not touch a network.

The files are read where each actor runs (the same paths on every node, as Ray's own
`RAY_TLS_*` files); private keys never travel. `check_files(tls)` — the driver's check before
any actor starts — reads each file, loads the chain and the CA, and completes one handshake
between a listener and a connector built from them over a local socket pair, so a key that
does not match its certificate, a certificate the CA did not sign or one that has expired is
found with its key named, before Ray starts.

    >>> from orchestrator.core.tls import check_files
    >>> check_files({"cert_file": "/nonexistent.pem", "key_file": "/nonexistent.key", "ca_file": "/nonexistent.ca"})[0]
    ('transport_tls.cert_file', '/nonexistent.pem', 'file not found')
"""
from __future__ import annotations

import os
import socket
import ssl
import stat
import threading
from collections.abc import Mapping

KEYS = ("cert_file", "key_file", "ca_file")
HANDSHAKE_S = 5.0      # the self-check's handshake deadline
MAX_PEM_BYTES = 1 << 20


class TlsError(ValueError):
    """A TLS file that cannot be used: `key` (e.g. transport_tls.key_file), `value`, `rule`."""

    def __init__(self, key: str, value: str, rule: str):
        super().__init__(f"cluster.{key} = {value!r}: {rule}")
        self.key, self.value, self.rule = key, value, rule


def _no_passphrase():
    raise TlsError("transport_tls.key_file", "", "the private key is encrypted with a passphrase; "
                   "give an unencrypted key file readable only by the user that runs Ray")


def _contexts(tls: Mapping[str, str]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False          # peers are addressed by node IP (module docstring)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(tls["cert_file"], tls["key_file"], password=_no_passphrase)
        except TlsError as e:
            raise TlsError(e.key, tls["key_file"], e.rule) from None
        except ssl.SSLError as e:
            raise TlsError("transport_tls.key_file", tls["key_file"],
                           f"cannot load it with cert_file {tls['cert_file']!r} ({e.reason or e}): "
                           "both must be PEM, the key the certificate's own") from None
        try:
            ctx.load_verify_locations(cafile=tls["ca_file"])
        except (ssl.SSLError, ValueError) as e:
            raise TlsError("transport_tls.ca_file", tls["ca_file"],
                           f"cannot load it as PEM CA certificates ({getattr(e, 'reason', None) or e})") from None
    server.num_tickets = 0                 # the listener writes nothing after the handshake
    return server, client


def contexts(tls: Mapping[str, str]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(listener context, connector context) for `tls` ({cert_file, key_file, ca_file});
    `TlsError` naming the key when a file cannot be used."""
    for key in KEYS:
        problem = _file_problem(tls[key])
        if problem:
            raise TlsError(f"transport_tls.{key}", tls[key], problem)
    return _contexts(tls)


def _file_problem(path: str) -> str | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "file not found"
    except OSError as e:
        return f"cannot stat it: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size == 0:
        return "is empty"
    if st.st_size > MAX_PEM_BYTES:
        return f"larger than {MAX_PEM_BYTES} bytes: not a PEM file"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"not readable: {e.strerror or e}"
    return None


def _self_handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> str | None:
    """One handshake between the two contexts over a socket pair; None, or why it failed."""
    a, b = socket.socketpair()
    a.settimeout(HANDSHAKE_S)
    b.settimeout(HANDSHAKE_S)
    errors: list[str] = []

    def serve():
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.sendall(b"\x01")
        except (OSError, ssl.SSLError) as e:
            errors.append(f"as a listener: {getattr(e, 'reason', None) or e}")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client.wrap_socket(b) as c:
            if c.recv(1) != b"\x01":
                errors.append("as a connector: the listener closed the connection")
    except (OSError, ssl.SSLError) as e:
        errors.append(f"as a connector: {getattr(e, 'verify_message', None) or getattr(e, 'reason', None) or e}")
    finally:
        b.close()
        t.join(HANDSHAKE_S)
        a.close()
    return "; ".join(errors) or None


def check_files(tls: Mapping[str, str] | None) -> list[tuple[str, str, str]]:
    """Problems (key, value, rule) with the `transport_tls` files, [] when they work (or tls is None):
    each file exists, is a readable regular file; the chain and the CA load; this certificate is
    accepted by this CA in a real handshake (signed by it, not expired)."""
    if tls is None:
        return []
    out = [(f"transport_tls.{key}", tls[key], p) for key in KEYS if (p := _file_problem(tls[key]))]
    if out:
        return out
    try:
        server, client = _contexts(tls)
    except TlsError as e:
        return [(e.key, e.value, e.rule)]
    why = _self_handshake(server, client)
    if why:
        return [("transport_tls.cert_file", tls["cert_file"],
                 (f"a handshake between two ends using it and ca_file {tls['ca_file']!r} failed ({why}): "
                  "the certificate must be signed by that CA and valid now"))]
    return []


def check_transport_tls(cluster) -> None:
    """The driver's check of `cluster.transport_tls` (see `check_files`), before anything starts.

    Raises:
      ConfigError: one line per problem, `cluster.transport_tls.<key> = <path>: <rule>`.
    """
    from orchestrator.core.config.errors import ConfigError, problem

    tls = getattr(cluster, "transport_tls", None)
    probs = check_files(None if tls is None else tls.model_dump())
    if probs:
        raise ConfigError([problem(f"cluster.{key}", value, rule) for key, value, rule in probs])
