"""A small gRPC client for `pdserve.v1.Generation` (used by `pdserve client`, the demo, tests)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    prompt: str | list[int], request_id: str = "", cache_salt: str = "", **sampling: Any
) -> gen.GenerateRequest:
    """`sampling` takes SamplingParams field names; None values stay unset."""
    params = gen.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    req = gen.GenerateRequest(request_id=request_id, sampling=params, cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    complete: gen.GenerateComplete | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # client clock per chunk

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
        }


class Client:
    def __init__(self, target: str, timeout_s: float | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s

    def stream(self, request: gen.GenerateRequest) -> Iterator[gen.GenerateResponse]:
        return self.stub.Generate(request, timeout=self.timeout_s)

    def generate(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        out = Completion()
        for resp in self.stream(make_request(prompt, **kwargs)):
            out.request_id = resp.request_id
            out.chunk_times_s.append(time.perf_counter())
            if resp.HasField("chunk"):
                out.token_ids.extend(resp.chunk.token_ids)
                out.text += resp.chunk.text
            else:
                out.complete = resp.complete
        return out

    def close(self) -> None:
        self.channel.close()


def run_client(
    target: str, prompt: str, max_tokens: int | None, temperature: float | None, as_json: bool
) -> int:
    client = Client(target)
    out = Completion()
    try:
        for resp in client.stream(
            make_request(prompt, max_tokens=max_tokens, temperature=temperature)
        ):
            out.request_id = resp.request_id
            if resp.HasField("chunk"):
                out.token_ids.extend(resp.chunk.token_ids)
                out.text += resp.chunk.text
                if not as_json:
                    print(resp.chunk.text, end="", flush=True)
            else:
                out.complete = resp.complete
    except grpc.RpcError as e:
        print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if as_json:
        print(json.dumps(out.to_json()))
    else:
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
