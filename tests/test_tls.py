"""TLS on the router's two ports (router/tls.py), with certificates made here.

A throwaway CA signs a server certificate (SAN localhost and 127.0.0.1, usable for client
auth too, as the Helm chart's mTLS probe needs) and a client certificate; a second CA signs
an intruder's client certificate. Then:

- one `pdserve serve --tls-cert --tls-key` subprocess with an API key (module-scoped): a TLS
  client with the key gets tokens (gRPC, HTTPS, `pdserve client`, `pdserve bench`); a
  plaintext client is refused on both ports; a wrong or missing key is UNAUTHENTICATED / 401;
  HTTP /health and gRPC health answer over TLS without the key;
- mTLS (`router.tls.client_ca`) in process: `start_server` and `start_http_server` on a
  router without workers; no client certificate, or one from another CA, fails the handshake
  on both ports; the CA's client certificate works, and so does the chart's readiness probe
  (k8s/helm/pdserve/files/health-probe.py) with the server's own certificate;
- bad settings fail early with a message naming the setting.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import io
import ipaddress
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli import build_parser, main, serve_config
from pdserve.client import Client, ClientTLS, open_channel
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc
from router.config import GrpcSettings, HttpSettings, RouterConfig, TlsSettings
from router.tls import ServerTLS
from tests.in_process import servers_without_workers
from tests.serve_proc import ROOT, ServeProcess

pytestmark = pytest.mark.timeout(420)  # the first server test includes the server's start

API_KEY = "sk-test-tls-0123456789"
PROBE = ROOT / "k8s" / "helm" / "pdserve" / "files" / "health-probe.py"
MAX_TOKENS = 4


# ---- certificates ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signs the server and the client
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody trusts
    intruder_cert: Path  # a client certificate from other_ca
    intruder_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _issue(
    cn: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    usages: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA (issuer None: self-signed) or a leaf certificate signed by `issuer`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(issuer_cert.subject if issuer_cert else _name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _issue("pdserve test CA", None)
    _write(d / "ca", *ca)
    server_usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    _write(d / "server", *_issue("localhost", ca, server_usages, sans))
    _write(d / "client", *_issue("client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH]))
    other = _issue("someone else's CA", None)
    _write(d / "other-ca", *other)
    _write(d / "intruder", *_issue("intruder", other, [ExtendedKeyUsageOID.CLIENT_AUTH]))
    return Pki(
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "other-ca.crt",
        d / "intruder.crt",
        d / "intruder.key",
    )


def https_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert and key:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


# ---- TLS without client certificates: one `pdserve serve` ---------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[ServeProcess]:
    tls_args = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    s = ServeProcess(
        tmp_path_factory.mktemp("pdserve-home"),
        extra_args=tls_args,
        env={"PDSERVE_API_KEY": API_KEY},
        ssl_context=https_context(pki.ca),
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"pdserve serve exited with {rc}:\n{s.log_tail()}"
    assert "pdserve: TLS on gRPC and HTTP" in s.log_path.read_text()


def tls_client(server: ServeProcess, pki: Pki, key: str | None = API_KEY, **tls: Any) -> Client:
    return Client(server.grpc_target, 60, ClientTLS(str(pki.ca), **tls), key)


def test_grpc_over_tls_with_the_key_streams_tokens(server: ServeProcess, pki: Pki) -> None:
    c = tls_client(server, pki)
    try:
        out = c.generate("hello", temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finally:
        c.close()
    assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
    # The certificate's DNS name works as well as its IP address.
    c = Client(f"localhost:{server.ports['gRPC']}", 60, ClientTLS(str(pki.ca)), API_KEY)
    try:
        assert c.stub.GetModelInfo(gen.GetModelInfoRequest(), timeout=30, metadata=c.metadata)
    finally:
        c.close()


def refused(client: Client) -> grpc.StatusCode:
    """The status a generate call through `client` fails with (it must fail); closes it."""
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("hello", max_tokens=MAX_TOKENS)
    finally:
        client.close()
    return e.value.code()


@pytest.mark.parametrize("key", [None, "wrong"])
def test_grpc_over_tls_without_the_key_is_unauthenticated(
    server: ServeProcess, pki: Pki, key: str | None
) -> None:
    assert refused(tls_client(server, pki, key)) == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_grpc_is_refused(server: ServeProcess) -> None:
    client = Client(server.grpc_target, 30, None, API_KEY)
    assert refused(client) == grpc.StatusCode.UNAVAILABLE


def test_grpc_refuses_a_server_it_does_not_trust(server: ServeProcess, pki: Pki) -> None:
    """The client side: a CA that did not sign the server's certificate fails the handshake."""
    client = Client(server.grpc_target, 30, ClientTLS(str(pki.other_ca)), API_KEY)
    assert refused(client) == grpc.StatusCode.UNAVAILABLE


def test_grpc_health_over_tls_needs_no_key(server: ServeProcess, pki: Pki) -> None:
    with open_channel(server.grpc_target, ClientTLS(str(pki.ca))) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_https_completions_need_the_key(server: ServeProcess) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, _, raw = server.request("POST", "/v1/completions", body, auth)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] >= 1
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, raw = server.request("POST", "/v1/completions", body, headers)
        assert status == 401, raw
    status, _, raw = server.request("GET", "/health")
    assert (status, json.loads(raw)) == (200, {"status": "ok"})


def test_plaintext_http_is_refused(server: ServeProcess) -> None:
    url = f"http://127.0.0.1:{server.ports['HTTP']}/health"
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(url, timeout=30).read()


def test_https_refuses_a_server_it_does_not_trust(server: ServeProcess, pki: Pki) -> None:
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(
            server.base_url + "/health", timeout=30, context=https_context(pki.other_ca)
        )


def test_client_command_over_tls(server: ServeProcess, pki: Pki) -> None:
    argv = ["client", "--target", server.grpc_target, "--tls-ca", str(pki.ca)]
    # --ignore-eos: the tiny model's greedy tokens reach its end-of-sequence token or not
    # depending on the kernels this CPU chose (a fresh clone got 2 of 4)
    argv += [
        "--api-key",
        API_KEY,
        "--max-tokens",
        str(MAX_TOKENS),
        "--ignore-eos",
        "--json",
        "hello",
    ]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    assert len(json.loads(buf.getvalue())["token_ids"]) == MAX_TOKENS


@pytest.mark.parametrize("api", ["grpc", "https"])
def test_bench_over_tls(server: ServeProcess, pki: Pki, api: str, tmp_path: Path) -> None:
    where = (
        ["--target", server.grpc_target]
        if api == "grpc"
        else ["--base-url", server.base_url, "--tokenizer", str(served_model_dir(server))]
    )
    argv = ["bench", *where, "--tls-ca", str(pki.ca), "--api-key", API_KEY]
    argv += ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2"]
    argv += ["--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)]
    argv += ["--result-filename", "r.json", "--max-failure-rate", "0"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 2


def served_model_dir(server: ServeProcess) -> Path:
    return Path(server.home) / "models" / "tiny-seed0-float32"  # what `--model tiny` resolved


# ---- mTLS, in process ---------------------------------------------------------------------
@dataclass
class MtlsServers:
    grpc_target: str
    http_port: int


@pytest.fixture(scope="module")
def mtls(pki: Pki) -> Iterator[MtlsServers]:
    cfg = RouterConfig(
        grpc=GrpcSettings(port=0),
        http=HttpSettings(port=0),
        tls=TlsSettings(str(pki.server_cert), str(pki.server_key), str(pki.ca)),
    )
    tls = ServerTLS.of(cfg)
    assert tls is not None and tls.mutual
    tls.check()
    with servers_without_workers(cfg) as (grpc_port, http_port):
        yield MtlsServers(f"127.0.0.1:{grpc_port}", http_port)


def model_info(target: str, tls: ClientTLS) -> gen.ModelInfo:
    with open_channel(target, tls) as channel:
        return gen_grpc.GenerationStub(channel).GetModelInfo(gen.GetModelInfoRequest(), timeout=30)


def https_health(port: int, ctx: ssl.SSLContext) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_mtls_grpc_needs_a_client_certificate_from_the_ca(mtls: MtlsServers, pki: Pki) -> None:
    mine = ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    assert model_info(mtls.grpc_target, mine).served_model_name == "m"
    intruder = ClientTLS(str(pki.ca), str(pki.intruder_cert), str(pki.intruder_key))
    for tls in (ClientTLS(str(pki.ca)), intruder):
        with pytest.raises(grpc.RpcError) as e:
            model_info(mtls.grpc_target, tls)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with open_channel(mtls.grpc_target, mine) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_mtls_https_needs_a_client_certificate_from_the_ca(mtls: MtlsServers, pki: Pki) -> None:
    port = mtls.http_port
    assert https_health(port, https_context(pki.ca, pki.client_cert, pki.client_key)) == 200
    for ctx in (
        https_context(pki.ca),
        https_context(pki.ca, pki.intruder_cert, pki.intruder_key),
    ):
        # TLS 1.3: the server's refusal arrives on the first read, after the client's finish.
        with pytest.raises((ssl.SSLError, OSError, http.client.HTTPException)):
            https_health(port, ctx)


def test_helm_mtls_readiness_probe(mtls: MtlsServers, pki: Pki) -> None:
    """The chart's exec probe, as the kubelet runs it: the server's own cert as client cert."""

    def probe(cert: Path, key: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(PROBE), str(mtls.http_port), str(cert), str(key)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    ok = probe(pki.server_cert, pki.server_key)
    assert ok.returncode == 0, ok.stderr
    refused = probe(pki.intruder_cert, pki.intruder_key)
    assert refused.returncode == 1 and "health probe" in refused.stderr


# ---- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"cert": "c.pem"}, "tls.cert and router.tls.key go together"),
        ({"key": "k.pem"}, "tls.cert and router.tls.key go together"),
        ({"client_ca": "ca.pem"}, "needs router.tls.cert and key"),
    ],
)
def test_router_config_refuses_half_a_tls_setting(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TlsSettings(**kw)


def test_server_tls_check_names_the_bad_setting(pki: Pki, tmp_path: Path) -> None:
    def check(cert: Path, key: Path, ca: Path | None = None) -> None:
        ServerTLS(str(cert), str(key), str(ca) if ca else None).check()

    check(pki.server_cert, pki.server_key, pki.ca)
    with pytest.raises(ValueError, match=r"router.tls.key: .*missing.key: no such file"):
        check(pki.server_cert, tmp_path / "missing.key")
    with pytest.raises(ValueError, match="cannot load them"):
        check(pki.server_cert, pki.client_key)  # not the certificate's key
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"router.tls.client_ca: .*not a PEM CA bundle"):
        check(pki.server_cert, pki.server_key, garbage)


def test_serve_flags_map_onto_the_router_config(pki: Pki) -> None:
    args = build_parser().parse_args(
        ["serve", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]
    )
    r = serve_config(args).router
    assert (r.tls.cert, r.tls.key, r.tls.client_ca) == ("c.pem", "k.pem", "ca.pem")


def test_serve_with_a_missing_certificate_fails_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.crt")
    assert main(["serve", "--tls-cert", missing, "--tls-key", missing]) == 2
    assert f"router.tls.cert: {missing}: no such file" in capsys.readouterr().err


def test_client_tls_flags(pki: Pki) -> None:
    parse = build_parser().parse_args
    assert ClientTLS.from_args(parse(["client", "hi"])) is None
    with pytest.raises(ValueError, match="need --tls-ca"):
        ClientTLS.from_args(parse(["client", "--tls-cert", str(pki.client_cert), "hi"]))
    with pytest.raises(ValueError, match="go together"):
        ClientTLS.from_args(
            parse(["client", "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "hi"])
        )
    with pytest.raises(ValueError, match="no such file"):
        ClientTLS("/nonexistent/ca.pem")
