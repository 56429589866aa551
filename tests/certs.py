"""Throwaway certificates for the auth tests: one CA and leaf certificates signed by it, made with the
``openssl`` command (no Python dependency). Every leaf has SANs ``DNS:localhost, IP:127.0.0.1`` and
both the serverAuth and clientAuth usages, so one file can be a process's server and client identity
(as the manager's is: it serves, and it dials workers with the same certificate).

    certs = make_certs(tmp_dir, ["memsvc-manager", "memsvc-worker", "intruder"])
    certs.ca, certs.cert("memsvc-manager"), certs.key("memsvc-manager")
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    dir: Path
    ca: Path
    ca_key: Path

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str | Path, cwd: Path) -> None:
    r = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{r.stderr}")


def make_certs(out: Path, names: Sequence[str], ca_name: str = "memsvc-test-ca") -> Certs:
    """A CA (``ca.pem``) and, per name, ``<name>.pem`` / ``<name>.key`` with CN=name, valid for a day."""
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = out / "ca.pem", out / "ca.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        ca_key,
        "-out",
        ca,
        "-days",
        "1",
        "-subj",
        f"/CN={ca_name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=out,
    )
    ext = out / "leaf.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    )
    for name in names:
        csr = out / f"{name}.csr"
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            csr,
            "-subj",
            f"/CN={name}",
            cwd=out,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            ext,
            cwd=out,
        )
    return Certs(out, ca, ca_key)


__all__ = ["Certs", "have_openssl", "make_certs"]
