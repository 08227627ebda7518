"""`/metrics` and the API key, against one `pdserve serve` subprocess started with
PDSERVE_API_KEY in its environment (tiny preset, temporary PDSERVE_HOME).

- The exposition parses with prometheus_client's parser; after N requests (HTTP and gRPC
  alike: both go through the router's one request path) the TTFT histogram count and the
  success counter equal N, and `pdserve:generation_tokens_total` is the sum of the
  completion_tokens the clients saw; worker metrics carry role=prefill|decode and
  worker=<name>; a client that disconnects mid-stream adds exactly one
  `request_success_total{finished_reason="abort"}`.
- Missing or wrong key: 401 over HTTP (OpenAI's error shape), UNAUTHENTICATED over gRPC;
  the right key works on both; /health, /metrics and gRPC health stay open.

The tests run in file order: the counting test comes first, on a fresh server.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.kernel_spec import NAMES as OPS
from pdserve.client import make_request
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc
from router.service import SERVICE_NAME
from tests.serve_proc import ROOT, ServeProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(420)  # the first test includes the server's start

API_KEY = "sk-test-pdserve-0123456789"
GOOD = (("authorization", f"Bearer {API_KEY}"),)
N_HTTP = 3
N_GRPC = 2
PROMPT = "The router exports one scrape target for the whole deployment."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("pdserve-home"), env={"PDSERVE_API_KEY": API_KEY})
    yield s
    rc = s.stop()
    log = s.log_path.read_text()
    assert API_KEY not in log and all(API_KEY not in line for line in s.stdout), "key leaked"
    assert rc == 0, f"pdserve serve exited with {rc}:\n{s.log_tail()}"


@pytest.fixture(scope="module")
def stub(server: ServeProcess) -> Iterator[gen_grpc.GenerationStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield gen_grpc.GenerationStub(channel)


def client(server: ServeProcess, key: str) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], sample: str, **labels: str) -> float:
    """Sum of the samples named `sample` whose labels include `labels`."""
    return sum(
        s.value
        for f in fams.values()
        for s in f.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def test_counts_after_n_requests(server: ServeProcess, stub: gen_grpc.GenerationStub) -> None:
    oa = client(server, API_KEY)
    prompt_tokens = completion_tokens = 0
    for i in range(N_HTTP):
        stream = i == 0
        r = oa.completions.create(
            model="tiny",
            prompt=f"{PROMPT} {i}",
            max_tokens=6,
            temperature=0.0,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            extra_body={"ignore_eos": True},
        )
        usage = [c.usage for c in r if c.usage][-1] if stream else r.usage
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
    for _ in range(N_GRPC):
        responses = list(
            stub.Generate(
                make_request(PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True),
                metadata=GOOD,
                timeout=60,
            )
        )
        prompt_tokens += responses[-1].complete.usage.prompt_tokens
        completion_tokens += responses[-1].complete.usage.completion_tokens
    # one rejected at admission (min_tokens over max_tokens), one refused for its key: neither
    # is served
    auth = {"Authorization": f"Bearer {API_KEY}"}
    bad = {"prompt": "x", "min_tokens": 100}
    assert server.request("POST", "/v1/completions", bad, auth)[0] == 400
    assert server.request("POST", "/v1/completions", {"prompt": "x"})[0] == 401

    n = N_HTTP + N_GRPC
    fams = families(server.metrics_text())
    ttft = fams["pdserve:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert value(fams, "pdserve:time_to_first_token_seconds_count", role="router") == n
    assert value(fams, "pdserve:e2e_request_latency_seconds_count", model_name="tiny") == n
    assert value(fams, "pdserve:request_success_total", finished_reason="length") == n
    assert value(fams, "pdserve:request_success_total") == n
    assert value(fams, "pdserve:request_rejected_total", code="INVALID_ARGUMENT") == 1
    assert value(fams, "pdserve:request_prefill_time_seconds_count") == n
    assert value(fams, "pdserve:kv_transfer_seconds_count") == n
    placed = "pdserve:request_prefill_placement_total"
    assert value(fams, placed, placement="disaggregated") == value(fams, placed) == n
    assert value(fams, "pdserve:request_queue_time_seconds_count") == n
    # 6 and 5 tokens: all but the first of each request are inter-token gaps
    itl = value(fams, "pdserve:inter_token_latency_seconds_count")
    assert itl == N_HTTP * 5 + N_GRPC * 4
    queries = value(fams, "pdserve:prefix_cache_queries_total")
    assert queries >= prompt_tokens > 0
    assert value(fams, "pdserve:prefix_cache_hits_total") <= queries
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket")]
    assert max(s.value for s in buckets) == n  # the +Inf bucket
    check_token_metrics(fams, n, prompt_tokens, completion_tokens)


def check_token_metrics(fams: dict[str, Any], n: int, prompt: int, completion: int) -> None:
    """The vLLM-named token metrics and the per-phase ones, after n disaggregated requests
    of 2+ tokens whose usage summed to `prompt` and `completion` tokens."""
    assert completion == N_HTTP * 6 + N_GRPC * 5
    assert value(fams, "pdserve:generation_tokens_total", role="router") == completion
    assert value(fams, "pdserve:prompt_tokens_total", model_name="tiny") == prompt
    computed = value(fams, "pdserve:prefill_tokens_computed_total")
    assert computed + value(fams, "pdserve:prefill_tokens_cached_total") == prompt
    assert computed > 0
    assert value(fams, "pdserve:request_prompt_tokens_sum") == prompt
    assert value(fams, "pdserve:request_generation_tokens_sum") == completion
    assert fams["pdserve:request_generation_tokens"].type == "histogram"
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_time_per_output_token_seconds",
        "time_to_second_token_seconds",
        "request_kv_transfer_bytes",
        "request_kv_transfer_seconds",
    ):
        assert value(fams, f"pdserve:{name}_count") == n, name
    assert value(fams, "pdserve:request_kv_transfer_bytes_sum") > 0
    assert value(fams, "pdserve:request_success_total", finished_reason="abort") == 0
    info = fams["pdserve:cache_config_info"].samples
    assert {s.labels["role"] for s in info} == {"prefill", "decode"}
    for s in info:
        assert s.value == 1 and int(s.labels["num_gpu_blocks"]) > 0
        assert s.labels["block_size"] and s.labels["cache_dtype"]


def test_disconnect_is_one_abort(server: ServeProcess) -> None:
    """A client that leaves mid-stream is counted once, as finished_reason="abort"."""

    def aborts() -> float:
        return value(
            families(server.metrics_text()),
            "pdserve:request_success_total",
            finished_reason="abort",
        )

    before = aborts()
    total_before = value(families(server.metrics_text()), "pdserve:request_success_total")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True})
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:  # a few tokens in: it is decoding
        events += resp.readline().startswith(b"data: {")
    conn.close()  # the client is gone
    assert server.wait_for(lambda: aborts() == before + 1, 20), server.metrics_text()
    time.sleep(1.0)  # and it stays one
    assert aborts() == before + 1
    assert value(families(server.metrics_text()), "pdserve:request_success_total") == (
        total_before + 1
    )


def test_worker_metrics_have_roles(server: ServeProcess) -> None:
    fams = families(server.metrics_text())
    for name in (
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
        "pdserve:kv_cache_usage_perc",
        "pdserve:num_preemptions",
    ):
        roles = {s.labels["role"] for s in fams[name].samples}
        assert {"prefill", "decode"} <= roles, (name, roles)
        for s in fams[name].samples:
            assert s.labels["model_name"] == "tiny"
            assert s.labels["worker"].startswith(f"pdserve-{s.labels['role']}-") or (
                s.labels["role"] == "router"
            )
    assert fams["pdserve:num_preemptions"].type == "counter"
    assert fams["pdserve:kv_cache_usage_perc"].type == "gauge"
    assert value(fams, "pdserve:kv_transfer_bytes_total", role="prefill") > 0
    assert value(fams, "pdserve:kv_transfer_failures_total", role="prefill") == 0
    # Decode workers report their workspace (0 bytes when idle: it is given back once no
    # request runs); the traffic above fitted its cap. Prefill workers never decode.
    ws = fams["pdserve:decode_workspace_bytes"]
    assert ws.type == "gauge"
    assert {s.labels["role"] for s in ws.samples} == {"decode"}
    assert all(s.value >= 0 for s in ws.samples)
    assert value(fams, "pdserve:decode_workspace_fallbacks_total", role="decode") == 0
    for s in fams["pdserve:kv_cache_usage_perc"].samples:
        assert 0.0 <= s.value <= 1.0
    # Each worker says which kernel each op runs (one chosen row per op) and what it timed.
    ks = fams["pdserve:kernel_candidate_milliseconds"].samples
    for worker in {s.labels["worker"] for s in ks}:
        chosen = [s for s in ks if s.labels["worker"] == worker and s.labels["chosen"] == "true"]
        assert sorted(s.labels["op"] for s in chosen) == sorted(OPS), (worker, chosen)
        assert all(s.value > 0 for s in chosen)
    assert {s.labels["role"] for s in ks} == {"prefill", "decode"}


def test_dashboard_queries_known_metrics(server: ServeProcess) -> None:
    """Every series the Grafana dashboard queries is one /metrics exports."""
    dashboard = json.loads((ROOT / "k8s" / "grafana" / "pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    wanted = {m for e in exprs for m in re.findall(r"pdserve:[a-z0-9_]+", e)}
    exported = {s.name for f in families(server.metrics_text()).values() for s in f.samples}
    assert len(wanted) >= 12
    assert wanted <= exported, sorted(wanted - exported)


def test_http_api_key(server: ServeProcess) -> None:
    status, _, body = server.request("GET", "/health")
    assert status == 200
    assert server.request("GET", "/metrics")[0] == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path, payload in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            status, hdrs, body = server.request(method, path, payload, headers)
            assert status == 401, (headers, path)
            assert hdrs.get("www-authenticate", hdrs.get("WWW-Authenticate")) == "Bearer"
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "invalid_api_key"
            assert API_KEY not in body.decode()
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    assert [m.id for m in client(server, API_KEY).models.list().data] == ["tiny"]
    r = client(server, API_KEY).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3


def test_grpc_api_key(server: ServeProcess, stub: gen_grpc.GenerationStub) -> None:
    bad = [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)]
    for metadata in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(make_request("hi", max_tokens=2), metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(gen.GetModelInfoRequest(), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetModelInfo(gen.GetModelInfoRequest(), metadata=GOOD, timeout=30).vocab_size
    req = make_request("hi", max_tokens=2, ignore_eos=True)
    out = list(stub.Generate(req, metadata=GOOD, timeout=60))
    assert out[-1].complete.usage.completion_tokens == 2
    with grpc.insecure_channel(server.grpc_target) as channel:  # health stays open
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
