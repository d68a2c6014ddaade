"""Throwaway TLS material for the transport's TLS tests and `benchmarks.tls_overhead` (the
`cryptography` package, which Ray's dependencies bring; without it `make_tls` raises ImportError,
and the tests skip).

    files = make_tls(tmp_path)            # {"cert_file", "key_file", "ca_file"}: a CA and a node cert it signed
    other = make_tls(tmp_path / "b")      # another CA: its certificates are strangers to the first
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool, days: float = 1.0):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(days=2)).not_valid_after(now + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    return b.sign(issuer_key, hashes.SHA256())


def make_tls(directory: Path, expired: bool = False) -> dict[str, str]:
    """A fresh CA and one node certificate it signed (valid a day, or expired a day ago), as PEM
    files in `directory`; the key files are 0o600."""
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, node_key = _key(), _key()
    ca = _cert("meshpipe test CA", ca_key, "meshpipe test CA", ca_key, ca=True)
    node = _cert("meshpipe node", node_key, "meshpipe test CA", ca_key, ca=False, days=-1.0 if expired else 1.0)
    files = {"cert_file": directory / "node.pem", "key_file": directory / "node.key", "ca_file": directory / "ca.pem"}
    files["cert_file"].write_bytes(node.public_bytes(serialization.Encoding.PEM))
    files["ca_file"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["key_file"].write_bytes(_pem_key(node_key))
    files["key_file"].chmod(0o600)
    return {k: str(v) for k, v in files.items()}
