"""The router's readiness probe when it requires client certificates (Helm `tls.clientCA`).

Kubernetes' httpGet probe cannot present a client certificate, so under mTLS the router
container runs this instead: GET /health over HTTPS on its own loopback, presenting the pod's
certificate (the `tls.secretName` Secret) as the client certificate. So that certificate must
be one the router accepts from a client: issued by the `tls.clientCA` CA and usable for client
authentication (extended key usage clientAuth, or none). The server's certificate is not
checked: the probe dials its own pod, whose certificate names the Service, not 127.0.0.1.

Usage: python3 health-probe.py PORT CERT KEY. Exit 0 when /health answers 200, else 1.
"""

from __future__ import annotations

import http.client
import ssl
import sys


def probe(port: int, cert_file: str, key_file: str, timeout_s: float = 4.0) -> int:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(cert_file, key_file)
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read(200).decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        print(f"health probe: {e!r}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if resp.status != 200:
        print(f"health probe: HTTP {resp.status} {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: health-probe.py PORT CERT KEY")
    sys.exit(probe(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
