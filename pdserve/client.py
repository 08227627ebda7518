"""A small gRPC client for `pdserve.v1.Generation` (used by `pdserve client`, the demo, tests)."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc

FINISH_NAMES = {
    gen.FINISH_REASON_STOP: "stop",
    gen.FINISH_REASON_LENGTH: "length",
    gen.FINISH_REASON_ABORT: "abort",
    gen.FINISH_REASON_UNSPECIFIED: "",
}


def make_request(
    prompt: str | list[int] | list[dict[str, str]],
    request_id: str = "",
    cache_salt: str = "",
    **sampling: Any,
) -> gen.GenerateRequest:
    """`prompt`: text, token ids or chat messages ({"role", "content"} each: the server's
    chat template renders them). `sampling` takes SamplingParams field names; None values
    stay unset."""
    params = gen.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    req = gen.GenerateRequest(request_id=request_id, sampling=params, cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        for m in prompt:
            assert isinstance(m, dict)
            req.chat.messages.add(role=m["role"], content=m["content"])
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return req


@dataclass
class Choice:
    """One choice of a request with n > 1 (chunks by `index`)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)  # choice 0's (n = 1: the request's)
    text: str = ""
    complete: gen.GenerateComplete | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # client clock per chunk
    choices: dict[int, Choice] = field(default_factory=dict)  # every choice, by index

    def add(self, c: gen.GenerateChunk) -> None:
        choice = self.choices.setdefault(c.index, Choice())
        choice.token_ids.extend(c.token_ids)
        choice.text += c.text
        if c.finish_reason:
            choice.finish_reason = FINISH_NAMES[c.finish_reason]
        if c.index == 0:
            self.token_ids.extend(c.token_ids)
            self.text += c.text

    @property
    def finish_reason(self) -> str:
        return FINISH_NAMES[self.complete.finish_reason] if self.complete else ""

    def to_json(self) -> dict[str, Any]:
        done = (
            json_format.MessageToDict(self.complete, preserving_proto_field_name=True)
            if self.complete
            else {}
        )
        done["finish_reason"] = self.finish_reason
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            **done,
            **(
                {"choices": [vars(self.choices[i]) for i in sorted(self.choices)]}
                if len(self.choices) > 1
                else {}
            ),
        }


@dataclass(frozen=True)
class ClientTLS:
    """TLS to a router started with `--tls-cert` (router/tls.py): the CA to trust and, for a
    router with `--tls-client-ca`, this client's own certificate and key (PEM files)."""

    ca_file: str  # the CA (bundle) that signed the server's certificate
    cert_file: str | None = None  # client certificate chain (mTLS), with key_file
    key_file: str | None = None
    server_name: str | None = None  # check the server's certificate for this name, not the host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (
            ("--tls-ca", self.ca_file),
            ("--tls-cert", self.cert_file),
            ("--tls-key", self.key_file),
        ):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientTLS | None:
        """From `add_tls_args` flags; None (plaintext) without --tls-ca."""
        if args.tls_ca is None:
            if args.tls_cert or args.tls_key or args.tls_server_name:
                raise ValueError("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
            return None
        return cls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None,
        )

    def grpc_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and identity for HTTPS clients."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="PEM CA to trust: connect over TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="name the server certificate must carry (default: the target's host)",
    )


def open_channel(target: str, tls: ClientTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.grpc_credentials(), options=tls.grpc_options())


def open_aio_channel(target: str, tls: ClientTLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=tls.grpc_options())


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    def __init__(
        self,
        target: str,
        timeout_s: float | None = None,
        tls: ClientTLS | None = None,
        api_key: str | None = None,
    ) -> None:
        self.channel = open_channel(target, tls)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = auth_metadata(api_key)

    def stream(self, request: gen.GenerateRequest) -> Iterator[gen.GenerateResponse]:
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    def generate(
        self,
        prompt: str | list[int],
        structured: gen.StructuredOutput | None = None,
        **kwargs: Any,
    ) -> Completion:
        """`structured`: the output's constraint (a JSON schema, a regex, ...)."""
        request = make_request(prompt, **kwargs)
        if structured is not None:
            request.structured_output.CopyFrom(structured)
        out = Completion()
        for resp in self.stream(request):
            out.request_id = resp.request_id
            out.chunk_times_s.append(time.perf_counter())
            if resp.HasField("chunk"):
                out.add(resp.chunk)
            else:
                out.complete = resp.complete
        return out

    def close(self) -> None:
        self.channel.close()


def run_client(args: argparse.Namespace) -> int:
    """`pdserve client`: stream one request to the terminal (with `--n` above 1, each
    choice is printed whole at the end, numbered: their chunks interleave)."""
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    client = Client(args.target, tls=ClientTLS.from_args(args), api_key=api_key)
    prompt: str | list[dict[str, str]] = (
        [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    )
    request = make_request(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        n=args.n,
        ignore_eos=args.ignore_eos,
    )
    streamed = not args.json and (args.n or 1) == 1
    out = Completion()
    try:
        for resp in client.stream(request):
            out.request_id = resp.request_id
            if resp.HasField("chunk"):
                out.add(resp.chunk)
                if streamed:
                    print(resp.chunk.text, end="", flush=True)
            else:
                out.complete = resp.complete
    except grpc.RpcError as e:
        print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(out.to_json()))
        return 0
    if not streamed:
        for i in sorted(out.choices):
            print(f"[{i}] {out.choices[i].text}")
    c = out.complete
    assert c is not None
    print(
        f"\n[{out.finish_reason}: {c.usage.completion_tokens} tokens, TTFT "
        f"{c.timings.ttft_ms:.1f} ms (queue {c.timings.queue_ms:.1f}, prefill "
        f"{c.timings.prefill_ms:.1f}, transfer {c.timings.transfer_ms:.1f}), "
        f"decode {c.timings.decode_ms:.1f} ms]",
        file=sys.stderr,
    )
    return 0
