"""The Helm chart (k8s/helm/pdserve), rendered offline with the Helm SDK (helm-python-sdk).

Profiles: the defaults (CPU, bundled Redis), a GPU profile (2 prefill x 1 GPU, 4 decode
x 1 GPU, GPU node pools), an external Redis (redis.url + redis.existingSecret, with every
other secret from an existing Secret too, the KV transfer shared secret among them), TLS
on the router's ports without and with client certificates (tls, mtls), a Hub model with a
token, a chat template and extra flags (hf), a model on a PVC (pvc), and an Ingress, an
HTTPRoute and a KEDA ScaledObject (exposed). Helm lint
finds no error, the values schema refuses bad values, every core Kubernetes object passes
kubernetes-validate (the CRDs, RayCluster, ServiceMonitor, HTTPRoute and ScaledObject, are
checked structurally here),
the ConfigMap's config loads with `ServeConfig.load`, and the two shell scripts the chart
runs (the router's start script, the bundled Redis's start command) are run here too.
Secrets: every one comes from a Secret by env (`secretKeyRef`), none is on a command line,
and by default the chart generates the API key and the KV transfer secret and restricts the
router's ports with a NetworkPolicy.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import redis
import yaml

from kv_transfer.auth import check_secret
from pdserve.cli import build_parser
from pdserve.cli import serve_config as cli_serve_config
from pdserve.config import ServeConfig

CHART = Path(__file__).resolve().parents[1] / "k8s" / "helm" / "pdserve"
RELEASE, NAMESPACE = "pd", "serving"
FULLNAME = "pd-pdserve"
RAY_PORTS = {6379, 8265, 10001}  # GCS, dashboard, Ray client
ROUTER_PORTS = {50051, 8000}
KUBE_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())  # kubeVersion >= 1.27
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/", "keda.sh/", "gateway.networking.k8s.io/")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HF_REVISION = "9fd5d5a2b1f5ad25f4d1b3d5a6c7e8f901234567"  # a commit: every pod the same snapshot
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": {
        "config": {"model": {"model": "/models/llama-8b", "dtype": "bfloat16"}},
        "modelStorage": {
            "enabled": True,
            "mountPath": "/models",
            "volume": {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        },
        "prefill": {
            "replicas": 2,
            "gpusPerWorker": 1,
            "nodeSelector": {"pdserve.io/pool": "prefill"},
            "tolerations": [GPU_TOLERATION],
        },
        "decode": {
            "replicas": 4,
            "gpusPerWorker": 1,
            "nodeSelector": {"pdserve.io/pool": "decode"},
            "tolerations": [GPU_TOLERATION],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {
                                    "matchLabels": {"app.kubernetes.io/component": "decode"}
                                },
                            },
                        }
                    ]
                }
            },
        },
        "serviceMonitor": {"enabled": True},
    },
    "external-redis": {
        "redis": {
            "enabled": False,
            "url": "rediss://pdserve@redis.example.internal:6380/2",
            "existingSecret": "external-redis",
            "existingSecretKey": "password",
        },
        "rayAuth": {"existingSecret": "ray-token"},
        "router": {"apiKey": {"existingSecret": "pdserve-api", "key": "key"}},
        "kvTransfer": {"sharedSecret": {"existingSecret": "pdserve-kv", "key": "secret"}},
    },
    "tls": {
        "tls": {"enabled": True, "secretName": "pd-tls"},
        "serviceMonitor": {
            "enabled": True,
            "tlsConfig": {"ca": {"secret": {"name": "pd-tls", "key": "ca.crt"}}},
        },
    },
    "mtls": {"tls": {"enabled": True, "secretName": "pd-tls", "clientCA": "pd-client-ca"}},
    # A Hub model with a token, a chat template and extra flags.
    "hf": {
        "model": {
            "uri": "hf://Qwen/Qwen2.5-0.5B-Instruct",
            "hfTokenSecret": {"name": "hf-token", "key": "token"},
            "chatTemplate": CHAT_TEMPLATE,
            "revision": HF_REVISION,
        },
        "router": {"extraArgs": ["--max-model-len", "4096", "--max-num-seqs=32"]},
    },
    "pvc": {"model": {"uri": "pvc://llama-weights/Llama-3.1-8B-Instruct"}},
    # Everything that exposes or scales: Ingress, HTTPRoute, KEDA (with its Prometheus).
    "exposed": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "host": "llm.example.com",
            "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
        },
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "public", "namespace": "gateways"}],
            "hostnames": ["llm.example.com"],
        },
        "autoscaling": {
            "enabled": True,
            "scaleTargetRef": {"name": "batch-client"},
            "prometheus": {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
        },
        "serviceMonitor": {"enabled": True},
    },
}
TLS_DIR, CLIENT_CA_DIR = "/etc/pdserve-tls", "/etc/pdserve-client-ca"
HF_HOME, PVC_DIR = "/var/cache/huggingface", "/mnt/pdserve-model"
CHAT_TEMPLATE_PATH = "/etc/pdserve/chat-template.jinja"


# ---- rendering ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, list[dict[str, Any]]]:
    return {name: render(chart, values) for name, values in PROFILES.items()}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def containers(pod_template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_template["spec"]["containers"]}


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rc = one(docs, "RayCluster")
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}


def serve_config(docs: list[dict[str, Any]], tmp_path: Path) -> ServeConfig:
    cm = one(docs, "ConfigMap", f"{FULLNAME}-config")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    return ServeConfig.load(path)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- lint and schema ------------------------------------------------------------------------
@pytest.mark.parametrize("profile", list(PROFILES))
def test_lint_reports_no_errors(profile: str) -> None:
    report = helm.lint(CHART, PROFILES[profile], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": {"replicas": -1}},
        {"decode": {"replicas": -2}},
        {"prefill": {"gpusPerWorker": -1}},
        {"decode": {"gpusPerWorker": 0.5}},  # nvidia.com/gpu is a whole number
        {"replicaCount": 3},  # unknown top-level key
        {"prefill": {"gpus": 1}},  # unknown key in a pool
        {"redis": {"password": "inline"}},  # no inline password key at all
        {"kvTransfer": {"sharedSecret": {"value": "inline"}}},  # nor an inline KV secret
        {"kvTransfer": {"sharedSecret": {"existingSecret": "kv", "key": ""}}},
        {"config": {"caches": {}}},  # not a section of the config tree
        {"router": {"grpcPort": 70000}},
        {"router": {"service": {"type": "ExternalName"}}},
        {"redis": {"url": "http://redis:6379"}},
        {"image": {"tag": ""}},
        {"tls": {"enabled": "yes"}},
        {"tls": {"caSecret": "x"}},
        {"router": {"apiKey": {"value": "inline"}}},  # no inline API key
        {"router": {"apiKey": {"enabled": "yes"}}},
        {"kvTransfer": {"sharedSecret": {"enabled": 1}}},
        {"networkPolicy": {"routerFrom": ["10.0.0.0/8"]}},  # peers are objects
        {"model": {"uri": "s3://bucket/llama"}},  # not a form the chart can mount or fetch
        {"model": {"uri": "hf://no-org"}},
        {"model": {"uri": "pvc://Bad_Claim/x"}},  # not a PVC name
        {"model": {"uri": "small"}},  # a preset that is not baked into the image
        {"model": {"hfTokenSecret": {"value": "hf_inline"}}},  # no inline token
        {"model": {"hfTokenSecret": {"name": "hf", "key": ""}}},
        {"model": {"uri": "hf://a/b", "revision": "main; rm -rf /"}},  # not a git ref
        {"router": {"extraArgs": "--max-model-len 4096"}},  # a list of words
        {"router": {"extraArgs": [4096]}},
        {"ingress": {"pathType": "Regex"}},
        {"ingress": {"path": "v1"}},
        {"httpRoute": {"parentRefs": [{"namespace": "gateways"}]}},  # a parentRef needs a name
        {"autoscaling": {"prometheus": {"threshold": "many"}}},
        {"autoscaling": {"prometheus": {"serverAddress": "prometheus:9090"}}},
        {"autoscaling": {"maxReplicaCount": 0}},
        {"autoscaling": {"scaleTargetRef": {"group": "ray.io"}}},
    ],
)
def test_schema_rejects_bad_values(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_schema_accepts_the_profiles(chart: Any, profile: str) -> None:
    chart.validate_schema(PROFILES[profile])


def test_schema_config_sections_are_the_serve_config_tree(chart: Any) -> None:
    sections = set(chart.schema["properties"]["config"]["properties"])
    assert sections == {f.name for f in fields(ServeConfig)}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"config": {"prefill": {"num_workers": 3}}}, "config.prefill.num_workers"),
        ({"config": {"decode": {"resources": {"x": 1}}}}, "config.decode.resources"),
        ({"config": {"router": {"grpc": {"port": 1}}}}, "config.router.grpc.port"),
        ({"config": {"router": {"http": {"port": 1}}}}, "config.router.http.port"),
        ({"config": {"index": {"redis_url": "redis://h"}}}, "config.index.redis_url"),
        # a secret in the ConfigMap would be readable by anyone who can read ConfigMaps
        (
            {"config": {"transfer": {"shared_secret": "0123456789abcdef"}}},
            "config.transfer.shared_secret",
        ),
        ({"config": {"model": {"device": "cuda"}}}, "config.model.device"),
        ({"config": {"router": {"api_key": "inline-key"}}}, "config.router.api_key"),
        (
            {"redis": {"enabled": False, "url": "redis://:hunter2@redis:6379/0"}},
            "must not hold a password",
        ),
        ({"prefill": {"gpusPerWorker": 1}}, "one device kind"),
        ({"config": {"router": {"tls": {"cert": "/c.pem"}}}}, "config.router.tls"),
        ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
        ({"tls": {"clientCA": "ca"}}, "tls.clientCA .mTLS. needs tls.enabled"),
        (
            {"model": {"uri": "tiny"}, "config": {"model": {"model": "/models/x"}}},
            "config.model.model and model.uri are both set",
        ),
        (
            {"model": {"chatTemplate": "{{ x }}"}, "config": {"model": {"chat_template": "/t"}}},
            "config.model.chat_template and model.chatTemplate are both set",
        ),
        ({"model": {"uri": "pvc://weights/../etc"}}, "must not contain . or .. segments"),
        ({"model": {"uri": "tiny", "revision": "main"}}, "model.revision applies to an hf://"),
        (
            {
                "model": {"uri": "hf://a/b", "revision": "main"},
                "config": {"model": {"revision": "v1"}},
            },
            "config.model.revision and model.revision are both set",
        ),
        ({"router": {"extraArgs": ["--api-key=hunter2"]}}, "--api-key is set by the chart"),
        ({"router": {"extraArgs": ["--api-key-file", "/k"]}}, "--api-key-file is set by"),
        (
            {"router": {"extraArgs": ["--model", "/m"]}},
            "--model is set by the chart: use model.uri",
        ),
        ({"router": {"extraArgs": ["--host=127.0.0.1"]}}, "--host is set by the chart"),
        ({"router": {"extraArgs": ["--redis-url", "redis://h"]}}, "--redis-url is set by"),
        ({"router": {"extraArgs": ["--no-http"]}}, "--no-http is set by the chart"),
        ({"router": {"extraArgs": ["--port", "80"]}}, "--port is set by the chart"),
        # argparse takes unambiguous prefixes: so does the check
        ({"router": {"extraArgs": ["--ho", "::"]}}, "--ho .--host. is set by the chart"),
        ({"router": {"extraArgs": ["--api-key-f=/k"]}}, "--api-key-f .--api-key-file. is set"),
        ({"httpRoute": {"enabled": True}}, "httpRoute.enabled needs httpRoute.parentRefs"),
        (
            {"autoscaling": {"enabled": True}},
            "autoscaling.enabled needs autoscaling.scaleTargetRef.name: KEDA cannot scale",
        ),
        (
            {"autoscaling": {"enabled": True, "scaleTargetRef": {"name": "d"}}},
            "autoscaling.enabled needs autoscaling.prometheus.serverAddress",
        ),
        (
            {
                "autoscaling": {
                    "enabled": True,
                    "scaleTargetRef": {"name": "d"},
                    "prometheus": {"serverAddress": "http://p:9090"},
                    "minReplicaCount": 5,
                    "maxReplicaCount": 2,
                }
            },
            "minReplicaCount is above",
        ),
    ],
)
def test_chart_refuses_values_it_cannot_honour(
    chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# ---- Kubernetes objects ---------------------------------------------------------------------
@pytest.mark.parametrize("profile", list(PROFILES))
def test_core_objects_pass_kubernetes_validate(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    docs = rendered[profile]
    core = [d for d in docs if not d["apiVersion"].startswith(CRD_GROUPS)]
    assert {d["kind"] for d in core} >= {"ConfigMap", "Service", "NetworkPolicy"}
    for doc in core:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    # The RayCluster's pod templates are core PodSpecs: validate them as Pods.
    rc = one(docs, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    for t in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": t["spec"]}
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)


def test_default_profile_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered["default"])
    assert kinds == [
        ("ConfigMap", f"{FULLNAME}-config"),
        ("NetworkPolicy", f"{FULLNAME}-ray"),
        ("NetworkPolicy", f"{FULLNAME}-redis"),
        ("NetworkPolicy", f"{FULLNAME}-router"),
        ("PodDisruptionBudget", f"{FULLNAME}-decode"),
        ("PodDisruptionBudget", f"{FULLNAME}-head"),
        ("PodDisruptionBudget", f"{FULLNAME}-prefill"),
        ("RayCluster", FULLNAME),
        ("Secret", f"{FULLNAME}-api-key"),
        ("Secret", f"{FULLNAME}-kv"),
        ("Secret", f"{FULLNAME}-ray-auth"),
        ("Secret", f"{FULLNAME}-redis"),
        ("Service", FULLNAME),
        ("Service", f"{FULLNAME}-redis"),
        ("StatefulSet", f"{FULLNAME}-redis"),
    ]


@pytest.mark.parametrize(
    "profile, expected",
    [
        ("default", {"prefill": (1, 0), "decode": (1, 0)}),
        ("gpu", {"prefill": (2, 1), "decode": (4, 1)}),
    ],
)
def test_raycluster_groups_and_gpus(
    rendered: dict[str, list[dict[str, Any]]],
    profile: str,
    expected: dict[str, tuple[int, int]],
    tmp_path: Path,
) -> None:
    docs = rendered[profile]
    rc = one(docs, "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    head = rc["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["num-cpus"] == "0"  # no pdserve actor on the head
    assert [c["name"] for c in head["template"]["spec"]["containers"]] == ["ray-head", "router"]
    cfg = serve_config(docs, tmp_path)
    by_group = groups(docs)
    assert set(by_group) == {"prefill", "decode"}
    for role, (replicas, gpus) in expected.items():
        g = by_group[role]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == replicas
        (worker,) = g["template"]["spec"]["containers"]
        limits = worker["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == gpus
        # `ray start --resources="..."`: one unit of the group's own resource per pod ...
        (arg,) = shlex.split(g["rayStartParams"]["resources"])
        assert json.loads(arg) == {f"pdserve_{role}": 1}
        # ... and the pool's actors ask for one unit each, and for the pod's GPUs.
        pool = getattr(cfg, role)
        assert pool.num_workers == replicas
        assert pool.num_gpus == gpus
        assert pool.resources == {f"pdserve_{role}": 1}
    assert cfg.model.device == ("cuda" if profile == "gpu" else "cpu")


def test_elastic_pools_span_the_planners_bounds(chart: Any, tmp_path: Path) -> None:
    """With the planner acting, each worker group spans the planner's bounds for its role
    (the chart's defaults are PlannerSettings') and KubeRay's autoscaler runs; with the
    planner advisory or off the groups stay fixed; replicas outside the bounds are refused."""
    from router.config import PlannerSettings

    default = PlannerSettings()
    acting = {"config": {"planner": {"enabled": True, "mode": "act", "max_decode": 6}}}
    docs = render(chart, acting)
    spec = one(docs, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    by_group = groups(docs)
    prefill, decode = by_group["prefill"], by_group["decode"]
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (
        default.min_prefill,
        default.max_prefill,
    )
    assert (decode["minReplicas"], decode["maxReplicas"]) == (default.min_decode, 6)
    assert prefill["replicas"] == decode["replicas"] == 1  # where the pools start
    planner = serve_config(docs, tmp_path).planner
    assert planner.enabled and planner.mode == "act" and planner.max_decode == 6
    for off in ({"enabled": True}, {"enabled": False, "mode": "act"}):  # advisory; off
        docs = render(chart, {"config": {"planner": off}})
        spec = one(docs, "RayCluster")["spec"]
        assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
        for g in groups(docs).values():
            assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 1
    outside = {**acting, "decode": {"replicas": 7}}
    with pytest.raises(helm.HelmRenderError, match=r"decode.replicas \(7\) is outside"):
        chart.render(outside, name=RELEASE, namespace=NAMESPACE)


def test_gpu_profile_places_groups_on_their_node_pools(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    by_group = groups(rendered["gpu"])
    for role in ("prefill", "decode"):
        spec = by_group[role]["template"]["spec"]
        assert spec["nodeSelector"] == {"pdserve.io/pool": role}
        assert spec["tolerations"] == [GPU_TOLERATION]
        (worker,) = spec["containers"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in worker[
            "volumeMounts"
        ]
    assert "podAntiAffinity" in by_group["decode"]["template"]["spec"]["affinity"]
    assert "affinity" not in by_group["prefill"]["template"]["spec"]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_configmap_config_loads_as_serve_config(
    rendered: dict[str, list[dict[str, Any]]], profile: str, tmp_path: Path
) -> None:
    cfg = serve_config(rendered[profile], tmp_path)
    assert cfg.ray.address == "auto"
    assert cfg.router.host == "0.0.0.0"
    assert (cfg.router.grpc.port, cfg.router.http.port) == (50051, 8000)
    assert cfg.transfer.host == "auto"  # each decode worker advertises its own pod IP
    assert cfg.index.redis_url is None  # the URL (and its password) comes at start, via env
    assert cfg.prefill.max_restarts == cfg.decode.max_restarts == -1
    model = {
        "gpu": "/models/llama-8b",
        "hf": "Qwen/Qwen2.5-0.5B-Instruct",
        "pvc": f"{PVC_DIR}/Llama-3.1-8B-Instruct",
    }
    assert cfg.model.model == model.get(profile, "smollm2-135m-instruct")
    assert cfg.model.chat_template == (CHAT_TEMPLATE_PATH if profile == "hf" else None)
    assert cfg.model.revision == (HF_REVISION if profile == "hf" else None)
    if profile == "gpu":
        assert cfg.model.dtype == "bfloat16"
    tls = (cfg.router.tls.cert, cfg.router.tls.key, cfg.router.tls.client_ca)
    if profile == "tls":
        assert tls == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", None)
    elif profile == "mtls":
        assert tls == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{CLIENT_CA_DIR}/ca.crt")
    else:
        assert tls == (None, None, None)


# ---- exposure -------------------------------------------------------------------------------
@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer"])
def test_services_expose_the_router_ports_only(chart: Any, service_type: str) -> None:
    for values in PROFILES.values():
        docs = render(chart, {**values, "router": {"service": {"type": service_type}}})
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        router = services.pop(FULLNAME)
        assert router["spec"]["type"] == service_type
        assert {p["port"] for p in router["spec"]["ports"]} == ROUTER_PORTS
        assert {p["targetPort"] for p in router["spec"]["ports"]} == {"grpc", "http"}
        head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
        assert matches(router["spec"]["selector"], head["metadata"]["labels"])
        assert {p["containerPort"] for p in containers(head)["router"]["ports"]} == ROUTER_PORTS
        # The only other Service is the bundled Redis's, and it stays inside the cluster.
        for svc in services.values():
            assert svc["metadata"]["name"] == f"{FULLNAME}-redis"
            assert svc["spec"]["type"] == "ClusterIP"
            assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "redis"
        for svc in [router, *services.values()]:
            if svc["spec"]["type"] != "ClusterIP":
                assert not {p["port"] for p in svc["spec"]["ports"]} & RAY_PORTS


def test_network_policies_keep_ray_ports_internal(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    rc = one(docs, "RayCluster")
    ray_pods = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    ray = one(docs, "NetworkPolicy", f"{FULLNAME}-ray")
    selector = ray["spec"]["podSelector"]["matchLabels"]
    assert all(matches(selector, t["metadata"]["labels"]) for t in ray_pods)
    assert ray["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = ray["spec"]["ingress"]  # every port: this release's Ray pods, nothing else
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert "ports" not in rule

    router = one(docs, "NetworkPolicy", f"{FULLNAME}-router")
    assert matches(
        router["spec"]["podSelector"]["matchLabels"],
        rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
    )
    (rule,) = router["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == ROUTER_PORTS
    assert rule["from"] == [{"podSelector": {}}]  # by default: this namespace's pods only

    redis_policy = one(docs, "NetworkPolicy", f"{FULLNAME}-redis")
    (rule,) = redis_policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert [p["port"] for p in rule["ports"]] == [6379]
    # No policy opens a Ray port to a source outside the release, save dashboardFrom.
    for pol in (d for d in docs if d["kind"] == "NetworkPolicy"):
        for rule in pol["spec"]["ingress"]:
            ports = {p["port"] for p in rule.get("ports", [])}
            if ports & RAY_PORTS or not ports:
                assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]


@pytest.mark.parametrize(
    "router_from",
    [
        [],  # open: any source (the rule has no `from`)
        [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}},
            {"ipBlock": {"cidr": "203.0.113.0/24"}},
        ],
    ],
)
def test_router_ports_accept_router_from(chart: Any, router_from: list[Any]) -> None:
    docs = render(chart, {"networkPolicy": {"routerFrom": router_from}})
    (rule,) = one(docs, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == ROUTER_PORTS
    if router_from:
        assert rule["from"] == router_from
    else:
        assert "from" not in rule
    for doc in docs:  # and every object still validates
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def test_dashboard_access_is_opt_in(chart: Any) -> None:
    admins = [{"namespaceSelector": {"matchLabels": {"name": "ray-admin"}}}]
    docs = render(chart, {"networkPolicy": {"dashboardFrom": admins}})
    rules = one(docs, "NetworkPolicy", f"{FULLNAME}-ray")["spec"]["ingress"]
    assert rules[1] == {"from": admins, "ports": [{"port": 8265, "protocol": "TCP"}]}


# ---- probes, secrets, auth ------------------------------------------------------------------
@pytest.mark.parametrize("profile", list(PROFILES))
def test_router_probes(rendered: dict[str, list[dict[str, Any]]], profile: str) -> None:
    head = one(rendered[profile], "RayCluster")["spec"]["headGroupSpec"]["template"]
    router = containers(head)["router"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"grpc": 50051, "http": 8000}
    readiness = router["readinessProbe"]
    if profile == "mtls":  # the kubelet has no client certificate: the router probes itself
        assert "httpGet" not in readiness
        assert readiness["exec"]["command"] == [
            "python3",
            "/etc/pdserve/health-probe.py",
            "8000",
            f"{TLS_DIR}/tls.crt",
            f"{TLS_DIR}/tls.key",
        ]
    elif profile == "tls":
        assert readiness["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    else:
        assert readiness["httpGet"] == {"path": "/health", "port": "http"}
    # TCP connects: unaffected by TLS
    assert router["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert router["startupProbe"]["tcpSocket"] == {"port": "grpc"}
    assert router["command"] == ["/bin/sh", "/etc/pdserve/start-router.sh"]


@pytest.mark.parametrize("profile", ["default", "tls", "mtls"])
def test_tls_secrets_are_mounted_where_the_config_points(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    docs = rendered[profile]
    spec = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in containers({"spec": spec})["router"]["volumeMounts"]}
    expected = {"tls": (TLS_DIR, "pd-tls", ["tls.crt", "tls.key"])}
    if profile == "mtls":
        expected["client-ca"] = (CLIENT_CA_DIR, "pd-client-ca", ["ca.crt"])
    if profile == "default":
        expected = {}
    assert {"tls", "client-ca"} & set(volumes) == set(expected)
    for name, (path, secret, keys) in expected.items():
        assert mounts[name] == {"name": name, "mountPath": path, "readOnly": True}
        assert volumes[name]["secret"]["secretName"] == secret
        assert [i["path"] for i in volumes[name]["secret"]["items"]] == keys
    # The probe script in the ConfigMap is the file tests/test_tls.py runs against a router.
    cm = one(docs, "ConfigMap", f"{FULLNAME}-config")
    script = CHART / "files" / "health-probe.py"
    assert cm["data"]["health-probe.py"] == script.read_text()
    # Only the router container sees the TLS key.
    rc = one(docs, "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        assert not {"tls", "client-ca"} & {v["name"] for v in g["template"]["spec"]["volumes"]}


def test_service_monitor_scrapes_https_with_tls(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    (endpoint,) = one(rendered["tls"], "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "pd-tls", "key": "ca.crt"}}}


def test_bundled_redis_password_comes_from_the_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    secret = one(docs, "Secret", f"{FULLNAME}-redis")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) >= 32
    ref = {"secretKeyRef": {"name": f"{FULLNAME}-redis", "key": "redis-password"}}
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    env = env_of(containers(head)["router"])
    assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"] == ref
    assert env["PDSERVE_REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
    sts = one(docs, "StatefulSet", f"{FULLNAME}-redis")
    redis_env = env_of(containers(sts["spec"]["template"])["redis"])
    assert redis_env["REDIS_PASSWORD"]["valueFrom"] == ref
    assert redis_env["REDISCLI_AUTH"]["valueFrom"] == ref
    sts_probes = containers(sts["spec"]["template"])["redis"]
    assert "exec" in sts_probes["readinessProbe"] and "exec" in sts_probes["livenessProbe"]
    # The password is in the Secret and nowhere else, in no form.
    for doc in docs:
        if doc is secret:
            continue
        text = json.dumps(doc)
        assert password not in text and secret["data"]["redis-password"] not in text


def test_external_redis_password_comes_from_the_existing_secret(
    rendered: dict[str, list[dict[str, Any]]], chart: Any
) -> None:
    docs = rendered["external-redis"]
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert not [d for d in docs if d["kind"] == "Secret"]  # both secrets are the user's
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    env = env_of(containers(head)["router"])
    assert env["PDSERVE_REDIS_URL"]["value"] == "rediss://pdserve@redis.example.internal:6380/2"
    assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "external-redis", "key": "password"}
    }
    assert env["PDSERVE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "pdserve-api", "key": "key"}
    }
    assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-redis"]
    # A Redis without a password, and no Redis at all (the router's in-memory index).
    docs = render(chart, {"redis": {"enabled": False, "url": "redis://cache:6379/0"}})
    env = env_of(containers(one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"])["router"])
    assert (
        "PDSERVE_REDIS_PASSWORD" not in env
        and env["PDSERVE_REDIS_URL"]["value"] == "redis://cache:6379/0"
    )
    docs = render(chart, {"redis": {"enabled": False}})
    env = env_of(containers(one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"])["router"])
    assert "PDSERVE_REDIS_PASSWORD" not in env and "PDSERVE_REDIS_URL" not in env


@pytest.mark.parametrize("profile", list(PROFILES))
def test_ray_token_auth_everywhere(rendered: dict[str, list[dict[str, Any]]], profile: str) -> None:
    docs = rendered[profile]
    secret_name = "ray-token" if profile == "external-redis" else f"{FULLNAME}-ray-auth"
    if profile != "external-redis":
        token = one(docs, "Secret", secret_name)
        assert len(base64.b64decode(token["data"]["auth-token"])) >= 32
        assert token["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    rc = one(docs, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    names = []
    for t in templates:
        assert t["spec"]["automountServiceAccountToken"] is False
        for c in t["spec"]["containers"]:
            env = env_of(c)
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
                "secretKeyRef": {"name": secret_name, "key": "auth-token"}
            }
            names.append(c["name"])
    assert sorted(names) == ["ray-head", "ray-worker", "ray-worker", "router"]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_kv_transfer_secret_reaches_the_worker_pods_only(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    """A secretKeyRef in both pools' workers (they hold the KV channels), not in the head
    pod (router and Ray head move no KV: `TransferConfig.resolve_secret` runs in workers
    only): the chart's generated Secret by default, or kvTransfer.sharedSecret.existingSecret."""
    docs = rendered[profile]
    rc = one(docs, "RayCluster")
    for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]:
        assert "PDSERVE_KV_SECRET" not in env_of(c)
    if profile == "external-redis":
        ref = {"name": "pdserve-kv", "key": "secret"}
        assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-kv"]
    else:
        ref = {"name": f"{FULLNAME}-kv", "key": "kv-secret"}
        generated = one(docs, "Secret", f"{FULLNAME}-kv")
        secret = base64.b64decode(generated["data"]["kv-secret"]).decode()
        check_secret(secret, "the generated KV secret")  # what the workers will demand
        assert len(secret) >= 32
    for role, group in groups(docs).items():
        env = env_of(containers(group["template"])["ray-worker"])
        assert env["PDSERVE_KV_SECRET"] == {
            "name": "PDSERVE_KV_SECRET",
            "valueFrom": {"secretKeyRef": ref},
        }, role
    config_yaml = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    assert "shared_secret" not in config_yaml


def test_kv_transfer_authentication_can_be_turned_off(chart: Any) -> None:
    docs = render(chart, {"kvTransfer": {"sharedSecret": {"enabled": False}}})
    assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-kv"]
    rc = one(docs, "RayCluster")
    for t in [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]:
        for c in t["spec"]["containers"]:
            assert "PDSERVE_KV_SECRET" not in env_of(c)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_api_key_comes_from_a_secret(
    rendered: dict[str, list[dict[str, Any]]], profile: str, tmp_path: Path
) -> None:
    """On by default: the chart's generated Secret, or router.apiKey.existingSecret; the
    router container only, by env; never in the ConfigMap's config."""
    docs = rendered[profile]
    if profile == "external-redis":
        ref = {"name": "pdserve-api", "key": "key"}
    else:
        ref = {"name": f"{FULLNAME}-api-key", "key": "api-key"}
        generated = one(docs, "Secret", f"{FULLNAME}-api-key")
        assert len(base64.b64decode(generated["data"]["api-key"])) >= 32
    rc = one(docs, "RayCluster")
    head = containers(rc["spec"]["headGroupSpec"]["template"])
    assert env_of(head["router"])["PDSERVE_API_KEY"] == {
        "name": "PDSERVE_API_KEY",
        "valueFrom": {"secretKeyRef": ref},
    }
    assert "PDSERVE_API_KEY" not in env_of(head["ray-head"])
    for group in groups(docs).values():
        assert "PDSERVE_API_KEY" not in env_of(containers(group["template"])["ray-worker"])
    assert serve_config(docs, tmp_path).router.api_key is None  # not in the ConfigMap


def test_api_key_can_be_turned_off(chart: Any) -> None:
    docs = render(chart, {"router": {"apiKey": {"enabled": False}}})
    assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-api-key"]
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert "PDSERVE_API_KEY" not in env_of(containers(head)["router"])


SECRET_ENV = {
    "RAY_AUTH_TOKEN",
    "PDSERVE_API_KEY",
    "PDSERVE_KV_SECRET",
    "PDSERVE_REDIS_PASSWORD",
    "REDIS_PASSWORD",
    "REDISCLI_AUTH",
}


def pod_templates(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rc = one(docs, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    templates += [d["spec"]["template"] for d in docs if d["kind"] == "StatefulSet"]
    return templates


def command_lines(container: dict[str, Any]) -> list[str]:
    """Every argv the container runs: command, args and exec probes."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        argv += container.get(probe, {}).get("exec", {}).get("command", [])
    return argv


@pytest.mark.parametrize("profile", list(PROFILES))
def test_no_secret_on_any_command_line(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    """`ps` and Ray's job table show a process's argv: every secret reaches its process by
    env from a Secret, and no generated value appears outside its own Secret."""
    docs = rendered[profile]
    generated = [
        base64.b64decode(v).decode()
        for d in docs
        if d["kind"] == "Secret"
        for v in d["data"].values()
    ]
    assert len(generated) == (0 if profile == "external-redis" else 4)
    for t in pod_templates(docs):
        for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
            argv = " ".join(command_lines(c))
            assert "--api-key" not in argv and "--redis-url" not in argv, c["name"]
            assert not [s for s in generated if s in argv], c["name"]
            for name, e in env_of(c).items():
                if name in SECRET_ENV:
                    assert set(e) == {"name", "valueFrom"}, name
                    assert set(e["valueFrom"]) == {"secretKeyRef"}, name
    for doc in docs:
        if doc["kind"] != "Secret":
            text = json.dumps(doc)
            assert not [s for s in generated if s in text], doc["metadata"]["name"]
    script = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["start-router.sh"]
    assert "--api-key" not in script and "--redis-url" not in script


def test_generated_secrets_are_kept_across_upgrades() -> None:
    """Each generated value is the live Secret's when there is one (`lookup`): an upgrade
    must not rotate a token, a password or a key under running pods and clients. (Offline
    renders have no cluster to look up, so this reads the template.)"""
    text = (CHART / "templates" / "secrets.yaml").read_text()
    generated = [ln for ln in text.splitlines() if "randAlphaNum" in ln]
    assert len(generated) == 4
    for line in generated:
        key = line.strip().split(":")[0]
        assert f'(index $live.data "{key}")' in line, line
    assert text.count('lookup "v1" "Secret" .Release.Namespace $name') == 4


@pytest.mark.parametrize("profile", list(PROFILES))
def test_one_pod_disruption_budget_per_role(
    rendered: dict[str, list[dict[str, Any]]], profile: str
) -> None:
    docs = rendered[profile]
    rc = one(docs, "RayCluster")
    pods = {"head": rc["spec"]["headGroupSpec"]["template"]} | {
        g["groupName"]: g["template"] for g in rc["spec"]["workerGroupSpecs"]
    }
    pdbs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {f"{FULLNAME}-{role}" for role in pods}
    for role, template in pods.items():
        pdb = pdbs[f"{FULLNAME}-{role}"]
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert matches(sel, template["metadata"]["labels"])
        others = [t for r, t in pods.items() if r != role]
        assert not any(matches(sel, t["metadata"]["labels"]) for t in others)
    assert pdbs[f"{FULLNAME}-head"]["spec"]["maxUnavailable"] == 0


def test_service_monitor_scrapes_the_router(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert not [d for d in rendered["default"] if d["kind"] == "ServiceMonitor"]
    docs = rendered["gpu"]
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    router = one(docs, "Service", FULLNAME)
    assert matches(sm["spec"]["selector"]["matchLabels"], router["metadata"]["labels"])
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


# ---- the scripts the chart runs -------------------------------------------------------------
def test_router_start_script_passes_secrets_by_env_only(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start-router.sh with stub `ray` (the head is up) and `pdserve` (prints its argv): the
    argv holds no secret whatever the env, and `pdserve serve` given that argv and the env
    the chart sets builds the Redis URL with its password, and the API key."""
    docs = rendered["default"]
    script = one(docs, "ConfigMap")["data"]["start-router.sh"]
    (tmp_path / "start-router.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pdserve").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    password, api_key = "p@ss:w/rd %1", "k3y-from-the-secret-0123456789"

    def run(**env: str) -> list[str]:
        out = subprocess.run(
            ["/bin/sh", str(tmp_path / "start-router.sh")],
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.splitlines()

    base = ["serve", "--config", "/etc/pdserve/config.yaml", "--ray-address", "auto"]
    assert run() == base
    config = tmp_path / "config.yaml"
    config.write_text(one(docs, "ConfigMap")["data"]["config.yaml"])
    for url, user, db in [
        ("redis://pd-redis.ns.svc:6379/0", None, 0),
        ("rediss://pdserve@r.example:6380/2", "pdserve", 2),
    ]:
        env = {
            "PDSERVE_REDIS_URL": url,
            "PDSERVE_REDIS_PASSWORD": password,
            "PDSERVE_API_KEY": api_key,
        }
        argv = run(**env)
        assert argv == base
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        argv[argv.index("/etc/pdserve/config.yaml")] = str(config)
        cfg = cli_serve_config(build_parser().parse_args(argv))
        assert cfg.router.api_key == api_key
        assert cfg.index.redis_url is not None
        kwargs = redis.ConnectionPool.from_url(cfg.index.redis_url).connection_kwargs
        assert (kwargs.get("username"), kwargs["password"], kwargs["db"]) == (user, password, db)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_bundled_redis_starts_with_the_password_from_env(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The StatefulSet's command (config on stdin), on a free port instead of 6379."""
    sts = one(rendered["default"], "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    command = container["command"][2]
    assert command.count("redis-server -") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = command.replace("redis-server -", f"redis-server - --port {port} --bind 127.0.0.1")
    password = "s3cret-from-env"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", command],
        env={**os.environ, "REDIS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong", socket_timeout=2).ping()
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):  # NOAUTH
            redis.Redis(port=port, socket_timeout=2).ping()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- the model, the chat template, extra flags ----------------------------------------------
def ray_pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The RayCluster's pod specs by role: head, prefill, decode."""
    rc = one(docs, "RayCluster")
    pods = {"head": rc["spec"]["headGroupSpec"]["template"]["spec"]}
    return pods | {g["groupName"]: g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]}


def serving_container(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The container that reads the checkpoint: the router in the head pod, else the worker."""
    return containers({"spec": spec})["router" if role == "head" else "ray-worker"]


@pytest.mark.parametrize(
    "uri, model",
    [
        ("", "smollm2-135m-instruct"),
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("tiny", "tiny"),
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("pvc://llama-weights", PVC_DIR),
        ("pvc://llama-weights/", PVC_DIR),
        ("pvc://llama-weights/meta/Llama-3.1-8B-Instruct", f"{PVC_DIR}/meta/Llama-3.1-8B-Instruct"),
        ("pvc://gguf.store/SmolLM2-360M.Q8_0.gguf", f"{PVC_DIR}/SmolLM2-360M.Q8_0.gguf"),
    ],
)
def test_model_uri(chart: Any, uri: str, model: str, tmp_path: Path) -> None:
    """Every form reaches the config as what `pdserve serve --model` takes, and is at the same
    path in the router and in every worker: baked into the image (a named model), the same
    PVC mounted read-only at one path (pvc://), or the snapshot each pod's init container
    downloaded into its own cache, read offline afterwards (hf://)."""
    docs = render(chart, {"model": {"uri": uri}})
    assert serve_config(docs, tmp_path).model.model == model
    kind = uri.split("://")[0] if "://" in uri else "named"
    for role, spec in ray_pods(docs).items():
        volumes = {v["name"]: v for v in spec["volumes"]}
        serving = serving_container(role, spec)
        mounts = {m["name"]: m for m in serving["volumeMounts"]}
        env = env_of(serving)
        inits = spec.get("initContainers", [])
        assert {"model-pvc", "hf-cache"} & set(volumes) == {
            "pvc": {"model-pvc"},
            "hf": {"hf-cache"},
            "named": set(),
        }[kind], role
        if kind == "pvc":
            assert volumes["model-pvc"]["persistentVolumeClaim"] == {
                "claimName": uri[len("pvc://") :].split("/")[0],
                "readOnly": True,
            }
            assert mounts["model-pvc"] == {
                "name": "model-pvc",
                "mountPath": PVC_DIR,
                "readOnly": True,
            }
        if kind == "hf":
            assert volumes["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
            assert mounts["hf-cache"] == {
                "name": "hf-cache",
                "mountPath": HF_HOME,
                "readOnly": True,
            }
            assert env["HF_HOME"]["value"] == HF_HOME and env["HF_HUB_OFFLINE"]["value"] == "1"
            (init,) = inits
            assert init["name"] == "fetch-model" and init["image"] == serving["image"]
            assert init["command"][:2] == ["python3", "-c"]
            assert init["command"][3:] == [model, ""]  # no model.revision: ""
            assert init["volumeMounts"] == [{"name": "hf-cache", "mountPath": HF_HOME}]
            assert env_of(init)["HF_HOME"] == {"name": "HF_HOME", "value": HF_HOME}
            assert "HF_TOKEN" not in env_of(init)  # no hfTokenSecret: no token
            assert init["securityContext"] == serving["securityContext"]
            assert "nvidia.com/gpu" not in init["resources"].get("limits", {})
        else:
            assert not inits and "HF_HOME" not in env, role
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def test_hf_model_token_reaches_the_init_containers_only(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["hf"]
    ref = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    for role, spec in ray_pods(docs).items():
        (init,) = spec["initContainers"]
        assert env_of(init)["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": ref}, role
        for c in spec["containers"]:
            assert "HF_TOKEN" not in env_of(c), (role, c["name"])
        assert "HF_TOKEN" not in " ".join(command_lines(init))


def test_hf_init_container_resolves_with_pdserve(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The init container's script, run here against a stub `pdserve.models`: it hands the
    repository to pdserve's own resolver and refuses a snapshot that needed a converted
    tokenizer outside the shared cache (the other pods would not see it)."""
    (init,) = ray_pods(rendered["hf"])["decode"]["initContainers"]
    script, repo, revision = init["command"][2:5]
    assert revision == HF_REVISION
    stub = tmp_path / "stub" / "pdserve"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "models.py").write_text(
        "import os\n"
        "def resolve_model(spec, revision=None):\n"
        "    return os.path.join(os.environ['RESOLVED_UNDER'], spec, revision)\n"
        "def require_tokenizer(path, spec):\n"
        "    pass\n"
    )
    for under, ok in [(HF_HOME + "/hub", True), ("/opt/pdserve/views", False)]:
        out = subprocess.run(
            [sys.executable, "-c", script, repo, revision],
            env={"PYTHONPATH": str(stub.parent), "HF_HOME": HF_HOME, "RESOLVED_UNDER": under},
            cwd=tmp_path,  # not the repository: the stub is the `pdserve` imported
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (out.returncode == 0) is ok, out.stderr
        if ok:
            assert out.stdout.strip() == f"{HF_HOME}/hub/{repo}/{HF_REVISION}"
        else:
            assert "has no tokenizer.json" in out.stderr


def test_chat_template_is_in_every_pod(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """model.chatTemplate: a ConfigMap key that the config points to, at the same path in the
    router and in every worker (the workers' engines read it too)."""
    docs = rendered["hf"]
    cm = one(docs, "ConfigMap", f"{FULLNAME}-config")
    assert cm["data"]["chat-template.jinja"] == CHAT_TEMPLATE + "\n"
    assert serve_config(docs, tmp_path).model.chat_template == CHAT_TEMPLATE_PATH
    for role, spec in ray_pods(docs).items():
        mount = {m["name"]: m for m in serving_container(role, spec)["volumeMounts"]}["config"]
        assert CHAT_TEMPLATE_PATH.startswith(mount["mountPath"] + "/") and mount["readOnly"]
        volume = {v["name"]: v for v in spec["volumes"]}["config"]["configMap"]
        assert volume["name"] == f"{FULLNAME}-config"
        if role != "head":  # the workers see the template and nothing else of the ConfigMap
            assert volume["items"] == [
                {"key": "chat-template.jinja", "path": "chat-template.jinja"}
            ]
    # No template: no key, no config entry, no ConfigMap in the workers.
    docs = rendered["default"]
    assert "chat-template.jinja" not in one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]
    for role in ("prefill", "decode"):
        assert "config" not in {v["name"] for v in ray_pods(docs)[role]["volumes"]}


def run_start_script(script: str, tmp_path: Path) -> list[str]:
    """start-router.sh with stub `ray` (the head is up) and `pdserve` (prints its argv)."""
    (tmp_path / "start-router.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pdserve").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    out = subprocess.run(
        ["/bin/sh", str(tmp_path / "start-router.sh")],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.splitlines()


def test_extra_args_reach_pdserve_serve_verbatim(
    chart: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """router.extraArgs follow the chart's flags word for word, whatever the shell would have
    made of them, and override the ConfigMap's config as flags do."""
    extra = [
        "--max-model-len",
        "4096",
        "--max-num-seqs=32",
        "--served-model-name",
        'it\'s $HOME `id` "q" * ;',
    ]
    docs = render(chart, {"router": {"extraArgs": extra}})
    cm = one(docs, "ConfigMap", f"{FULLNAME}-config")
    argv = run_start_script(cm["data"]["start-router.sh"], tmp_path)
    base = ["serve", "--config", "/etc/pdserve/config.yaml", "--ray-address", "auto"]
    assert argv == base + extra
    config = tmp_path / "config.yaml"
    config.write_text(cm["data"]["config.yaml"])
    argv[argv.index("/etc/pdserve/config.yaml")] = str(config)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = cli_serve_config(build_parser().parse_args(argv))
    assert cfg.scheduler.max_model_len == 4096 and cfg.scheduler.max_num_seqs == 32
    assert cfg.model.served_model_name == extra[-1]
    assert cfg.model.model == "smollm2-135m-instruct"  # from the ConfigMap
    # The router container itself runs the script and nothing else.
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert command_lines(containers(head)["router"]) == ["/bin/sh", "/etc/pdserve/start-router.sh"]


# ---- Ingress, HTTPRoute, KEDA ---------------------------------------------------------------
def test_default_render_exposes_and_scales_nothing_more(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["default"]
    assert not [d for d in docs if d["kind"] in {"Ingress", "HTTPRoute", "ScaledObject"}]
    for role, spec in ray_pods(docs).items():
        assert "initContainers" not in spec, role
        assert not {"model-pvc", "hf-cache"} & {v["name"] for v in spec["volumes"]}
    assert serve_config(docs, tmp_path).model.model == "smollm2-135m-instruct"
    script = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["start-router.sh"]
    assert script.rstrip().endswith(
        "exec pdserve serve --config /etc/pdserve/config.yaml --ray-address auto"
    )


def test_ingress_routes_the_http_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["exposed"]
    ingress = one(docs, "Ingress", FULLNAME)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(ingress, version, strict=True)
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    service = one(docs, "Service", FULLNAME)
    assert path["backend"]["service"] == {"name": FULLNAME, "port": {"name": "http"}}
    assert "http" in {p["name"] for p in service["spec"]["ports"]}


def test_ingress_without_host_matches_every_host(chart: Any) -> None:
    ingress = one(render(chart, {"ingress": {"enabled": True}}), "Ingress")
    kubernetes_validate.validate(ingress, KUBE_VERSIONS[-1], strict=True)
    (rule,) = ingress["spec"]["rules"]
    assert "host" not in rule and "ingressClassName" not in ingress["spec"]


def test_http_route_attaches_the_http_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A Gateway API CRD (kubernetes-validate has no schema for it): checked by hand against
    the fields gateway.networking.k8s.io/v1 requires."""
    docs = rendered["exposed"]
    route = one(docs, "HTTPRoute", FULLNAME)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    spec = route["spec"]
    assert spec["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
    assert all(ref["name"] for ref in spec["parentRefs"])
    assert spec["hostnames"] == ["llm.example.com"]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    service = one(docs, "Service", FULLNAME)
    http_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"]
    assert backend == {"name": FULLNAME, "port": http_port}
    assert isinstance(backend["port"], int)


def test_keda_scaled_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A KEDA CRD, checked by hand: it scales the named target (a RayCluster worker group has
    no /scale subresource), on the router's waiting requests as Prometheus scrapes them."""
    docs = rendered["exposed"]
    so = one(docs, "ScaledObject", FULLNAME)
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"name": "batch-client"}  # KEDA's default: apps/v1 Deployment
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (30, 300)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values())  # KEDA's trigger metadata is strings
    assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert meta["query"] == (
        f'sum(pdserve:num_requests_waiting{{role="router",namespace="{NAMESPACE}",'
        f'service="{FULLNAME}"}})'
    )
    assert float(meta["threshold"]) == 5
    # The query's `service` label is the router Service's name, as the ServiceMonitor scrapes it.
    sm = one(docs, "ServiceMonitor")
    assert matches(
        sm["spec"]["selector"]["matchLabels"], one(docs, "Service", FULLNAME)["metadata"]["labels"]
    )
    assert spec["scaleTargetRef"].get("kind") != "RayCluster"


def test_keda_scaled_object_takes_a_target_and_a_query(chart: Any) -> None:
    values = {
        "autoscaling": {
            "enabled": True,
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "consumers"},
            "minReplicaCount": 0,
            "maxReplicaCount": 10,
            "prometheus": {
                "serverAddress": "https://thanos.example:9090",
                "query": "max(pdserve:num_requests_waiting)",
                "threshold": "2.5",
            },
        }
    }
    spec = one(render(chart, values), "ScaledObject")["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "consumers",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 10)
    (trigger,) = spec["triggers"]
    assert trigger["metadata"]["query"] == "max(pdserve:num_requests_waiting)"
    assert trigger["metadata"]["threshold"] == "2.5"
