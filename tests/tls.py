"""TLS in tests: a self-signed certificate for 127.0.0.1 / localhost (made with the openssl command),
a client context that trusts it, and deploy/haproxy.cfg pointed at it."""
from __future__ import annotations

import re
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certificate:
    cert: Path  # PEM certificate
    key: Path  # PEM private key
    pem: Path  # both in one file, as HAProxy's `crt` takes them

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this certificate only (hostname checked: 127.0.0.1)."""
        return ssl.create_default_context(cafile=str(self.cert))


def certificate(folder: Path) -> Certificate:
    """A fresh self-signed certificate for 127.0.0.1 and localhost in `folder`, or a skip without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed (it makes the test's certificate)")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, pem = folder / "cert.pem", folder / "key.pem", folder / "haproxy.pem"
    done = subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                           "subjectAltName=DNS:localhost,IP:127.0.0.1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pem.write_text(cert.read_text() + key.read_text())
    return Certificate(cert, key, pem)


def haproxy_crt(cfg: str) -> str:
    """The PEM file deploy/haproxy.cfg's TLS bind names."""
    m = re.search(r"^\s*bind \S+ ssl crt (\S+)", cfg, re.M)
    assert m, "deploy/haproxy.cfg has no TLS bind (bind ... ssl crt FILE)"
    return m.group(1)


def with_certificate(cfg: str, pem: Path, tls_bind: str | None = None) -> str:
    """deploy/haproxy.cfg's text with its TLS bind on `pem` (and on `tls_bind`, e.g. 127.0.0.1:PORT)."""
    cfg = cfg.replace(haproxy_crt(cfg), str(pem))
    if tls_bind is not None:
        cfg = re.sub(r"(?m)^(\s*bind )\S+( ssl crt )", rf"\g<1>{tls_bind}\g<2>", cfg)
    return cfg
