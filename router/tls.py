"""TLS on the router's two ports (`router.tls.cert`, `router.tls.key`, `router.tls.client_ca`).

gRPC and HTTP serve the same certificate. With a client CA both also require a client
certificate it signed (mTLS): a client without one fails the handshake, before any request or
API key is looked at. TLS sits below the API key (router/auth.py), it does not replace it.

Health stays reachable: HTTP /health and grpc.health.v1 need no API key, only the TLS (and,
with mTLS, a client certificate). Kubernetes probes: k8s/README.md.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from router.config import RouterConfig


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str  # PEM certificate chain, leaf first
    key_file: str  # PEM private key of the leaf, unencrypted
    client_ca_file: str | None  # PEM CA bundle; set: clients must present a cert it signed

    @classmethod
    def of(cls, cfg: RouterConfig) -> ServerTLS | None:
        """The router's TLS settings, or None when it serves plaintext."""
        if cfg.tls.cert is None or cfg.tls.key is None:
            return None
        return cls(cfg.tls.cert, cfg.tls.key, cfg.tls.client_ca)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def check(self) -> None:
        """Load every file once, so a bad one fails `pdserve serve` before any worker starts.

        Raises ValueError naming the setting: a missing file, a file that is not PEM, a key
        that does not match the certificate, or an encrypted key (never prompted for).
        """
        for name, path in self._files():
            if not Path(path).is_file():
                raise ValueError(f"router.{name}: {path}: no such file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file, password=_no_password)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(
                f"router.tls.cert / router.tls.key ({self.cert_file}, {self.key_file}): "
                f"cannot load them as a PEM certificate chain and its unencrypted key ({e})"
            ) from e
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(
                    f"router.tls.client_ca: {self.client_ca_file}: not a PEM CA bundle ({e})"
                ) from e

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of `uvicorn.Config` for the same certificate (and client CA)."""
        options: dict[str, Any] = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file is not None:
            options.update(ssl_ca_certs=self.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def _files(self) -> list[tuple[str, str]]:
        files = [("tls.cert", self.cert_file), ("tls.key", self.key_file)]
        if self.client_ca_file is not None:
            files.append(("tls.client_ca", self.client_ca_file))
        return files


def _no_password() -> bytes:
    raise ValueError("the key is encrypted; pdserve needs an unencrypted key file")


def add_port(server: grpc.aio.Server, address: str, cfg: RouterConfig) -> int:
    """Bind `address` with TLS when the config has a certificate, else plaintext; the port."""
    tls = ServerTLS.of(cfg)
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.grpc_credentials())
