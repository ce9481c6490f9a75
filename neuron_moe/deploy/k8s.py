"""`neuron-moe deploy k8s`: plain Kubernetes YAML that serves a published artifact on inf2 nodes of a
cluster running AWS's Neuron device plugin (EKS), its Neuron resource counts derived from the plan, so
that they cannot drift from what `neuron-moe plan` says the artifact needs.

Written to DIR, one object per file, so that `kubectl apply -f DIR` applies exactly the first three:

  deployment.yaml   the server pods: the Neuron resources the TP degree needs, the toleration for the
                    `aws.amazon.com/neuron` taint, a node selector on the instance type; an init step
                    that pulls and verifies the artifact (`neuron-moe pull`) into the node's artifact
                    cache (a hostPath: replicas on one node pull once, at the path `serve --artifacts
                    s3://...` would use); startup and readiness probes on /health (503 while loading,
                    warming up or draining), liveness on /version; a termination grace period above
                    the drain timeout; the API key from a Secret
  service.yaml      a ClusterIP Service on the server's port
  hpa.yaml          a HorizontalPodAutoscaler (autoscaling/v2) on the pods' average waiting requests
  prometheus/scrape-config.yaml    a Prometheus `scrape_configs` job for the pods' /metrics
  prometheus/adapter-rules.yaml    the Prometheus adapter's rule that serves `vllm:num_requests_waiting`
                                   to the autoscaler through the custom metrics API

The TP degree is --tp (the artifact's), else the smallest degree whose plan (`neuron/plan.py`, the
instance table there) fits the instance: the most replicas a node holds. It becomes TP
`aws.amazon.com/neuroncore` cores, or, with --resource neuron, enough whole chips
(`aws.amazon.com/neuron`, CORES_PER_CHIP cores each). Nothing here has run on a cluster: the files are
validated offline against Kubernetes' schemas (tests/test_deploy.py).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .. import __version__
from ..errors import UserError
from ..neuron.plan import CORES_PER_CHIP, INSTANCES, port_plan
from ..publish.s3 import parse_uri
from ..report import atomic_dir, check_output, table
from ..run_config import RunConfig
from ..spec import DEFAULT_NEURON_IMAGE, DEPLOY_RESOURCES, DRAIN_TIMEOUT_S, TP_DEGREES, compiled_backend
from ..spec import DEFAULT_QUANTIZED_LAYERS

RESOURCES = DEPLOY_RESOURCES  # the Neuron device plugin's resources, by --resource
NEURON_TAINT = "aws.amazon.com/neuron"  # EKS's Neuron node groups carry it (NoSchedule)
INSTANCE_LABEL = "node.kubernetes.io/instance-type"

PORT = 8080  # the images' $PORT, and SageMaker's
UID = 10001  # the images' model-server user
DEFAULT_IMAGE = DEFAULT_NEURON_IMAGE
CACHE_HOST_PATH = "/var/cache/neuron-moe/artifacts"  # on the node: one pull per node and artifact
CACHE_MOUNT = "/artifacts-cache"  # in the pod
PRESTOP_S = 5  # before SIGTERM, so that the Service stops sending new requests first
# past the drain deadline: uvicorn's own grace to send what it cut (serve/server.py, 5 s) and the exit
GRACE_MARGIN_S = 15
STARTUP_PERIOD_S = 10
STARTUP_WINDOW_S = 30 * 60  # loading onto the NeuronCores and warming up: the Neuron image's start period
WAITING_METRIC = "vllm:num_requests_waiting"  # serve/metrics.py
HPA_METRIC = "vllm_num_requests_waiting"  # its name in the custom metrics API (the adapter rule renames it)
OBJECTS = ("deployment.yaml", "service.yaml", "hpa.yaml")
PROMETHEUS = ("prometheus/scrape-config.yaml", "prometheus/adapter-rules.yaml")
FILES = OBJECTS + PROMETHEUS
INT32_MAX = 2**31 - 1  # Kubernetes' schemas: replicas, minReplicas and maxReplicas are int32
MAX_DRAIN_S = 24 * 3600  # --drain-timeout: a longer drain is a typo (SageMaker's is 20 s, serve's default 60)
NAME = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")  # a DNS-1035 label (a Service's), room left for pod suffixes
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a Secret's or a service account's name


@dataclass(frozen=True)
class Settings:
    model: str
    instance: str
    artifacts: str  # s3://bucket/prefix
    quantization: str = "none"
    quantized_layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS  # the layer groups in `quantization`
    tp: int | None = None  # None: the smallest degree whose plan fits
    resource: str = "neuroncore"  # a RESOURCES key
    replicas: int = 1
    max_replicas: int | None = None  # None: 4 x replicas
    target_waiting: float = 2.0
    name: str = "neuron-moe"
    image: str = DEFAULT_IMAGE
    api_key_secret: str | None = None  # None: <name>-api-key
    service_account: str | None = None
    drain_timeout: float = DRAIN_TIMEOUT_S


def resolve_tp(
    port, instance: str, quantization: str, tp: int | None, layers: tuple[str, ...] = DEFAULT_QUANTIZED_LAYERS
) -> tuple[int, dict]:
    """(the TP degree, its plan, `layers` in `quantization`): `tp` where given (it must shard and fit the
    instance's cores; the plan's memory verdict is the artifact builder's call), else the smallest degree
    whose plan fits."""
    cores = INSTANCES[instance].cores

    def plan_at(degree: int) -> dict:
        backend = compiled_backend("deploy", degree, quantization, quantized_layers=layers)
        return port_plan(port, RunConfig(backend=backend), instance)

    if tp is not None:
        if tp > cores:
            raise UserError(f"--tp {tp}: {instance} has {cores} NeuronCores")
        report = plan_at(tp)
        if "per_rank_bytes" not in report:
            raise UserError(f"--tp {tp}: {report['reason']}")
        return tp, report
    tried = []
    for degree in sorted(d for d in TP_DEGREES if d <= cores):
        try:
            report = plan_at(degree)
        except UserError as e:  # a format whose groups a rank holds only part of, at this degree
            tried.append(f"TP {degree}: {e}")
            continue
        if report["fits"]:
            return degree, report
        tried.append(f"TP {degree}: {report['reason']}")
    raise UserError(
        f"{port.name} with --quantization {quantization} fits {instance} at no TP degree ({'; '.join(tried)}); "
        f"an artifact built at a degree anyway is deployed with --tp"
    )


def neuron_resource(resource: str, tp: int) -> tuple[str, int]:
    """(the device plugin's resource name, the count a pod of TP `tp` asks for)."""
    return RESOURCES[resource], tp if resource == "neuroncore" else math.ceil(tp / CORES_PER_CHIP)


def pods_per_node(instance: str, resource: str, count: int) -> int:
    inst = INSTANCES[instance]
    return (inst.cores if resource == "neuroncore" else inst.chips) // count


def cache_dir(artifacts: str) -> str:
    """Where the pod finds the pulled artifact: serve's own layout of an --artifacts-cache
    (`serve/server.py: s3_cache_dir`), under the node's cache."""
    bucket, prefix = parse_uri(artifacts)
    if not prefix:
        raise UserError(f"--artifacts {artifacts}: no prefix (a publication is s3://bucket/prefix)")
    return "/".join([CACHE_MOUNT, bucket, prefix])


def max_replicas(settings: Settings) -> int:
    """The autoscaler's most: --max-replicas, else 4 x --replicas within int32."""
    return settings.max_replicas or min(4 * settings.replicas, INT32_MAX)


def grace_period(settings: Settings) -> int:
    """terminationGracePeriodSeconds: the preStop pause, the drain, then uvicorn's own grace and the exit."""
    return PRESTOP_S + math.ceil(settings.drain_timeout) + GRACE_MARGIN_S


def _labels(settings: Settings) -> dict:
    return {"app.kubernetes.io/name": "neuron-moe", "app.kubernetes.io/instance": settings.name}


def _object(api_version: str, kind: str, settings: Settings, spec: dict) -> dict:
    """A Kubernetes object of this release: named and labelled after it, with its `spec`."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": settings.name, "labels": _labels(settings)},
        "spec": spec,
    }


def _probe(path: str, period: int, timeout: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _non_root() -> dict:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "allowPrivilegeEscalation": False}


def deployment(settings: Settings, port, tp: int) -> dict:
    resource, count = neuron_resource(settings.resource, tp)
    local = cache_dir(settings.artifacts)
    serve_args = ["--model", port.name, "--backend", "neuron", "--artifacts", local]
    serve_args += ["--drain-timeout", f"{settings.drain_timeout:g}"]
    secret = settings.api_key_secret or f"{settings.name}-api-key"
    pod = {
        "nodeSelector": {INSTANCE_LABEL: settings.instance},
        "tolerations": [{"key": NEURON_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": grace_period(settings),
        "initContainers": [
            {  # the hostPath is created root-owned; the pull runs as the image's user
                "name": "cache-owner",
                "image": settings.image,
                "command": ["chown", f"{UID}:{UID}", CACHE_MOUNT],
                "securityContext": {
                    "runAsUser": 0,
                    "runAsNonRoot": False,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
                },
                "volumeMounts": [{"name": "artifacts-cache", "mountPath": CACHE_MOUNT}],
            },
            {  # each file's size and sha256 checked against the publication before it lands; files already
                # there with their sha256 are kept (a second replica on the node re-verifies, downloads nothing)
                "name": "pull",
                "image": settings.image,
                "command": ["neuron-moe", "pull", settings.artifacts, local],
                "securityContext": _non_root(),
                "volumeMounts": [{"name": "artifacts-cache", "mountPath": CACHE_MOUNT}],
            },
        ],
        "containers": [
            {
                "name": "server",
                "image": settings.image,
                "args": serve_args,  # after the image's entrypoint: neuron-moe serve --host $HOST --port $PORT
                "env": [
                    {"name": "HOST", "value": "0.0.0.0"},
                    {"name": "PORT", "value": str(PORT)},
                    {"name": "NEURON_MOE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": "api-key"}}},
                ],
                "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
                "resources": {"limits": {resource: count}},
                "volumeMounts": [{"name": "artifacts-cache", "mountPath": CACHE_MOUNT, "readOnly": True}],
                "startupProbe": _probe("/health", STARTUP_PERIOD_S, 5, STARTUP_WINDOW_S // STARTUP_PERIOD_S),
                "readinessProbe": _probe("/health", 5, 3, 2),
                "livenessProbe": _probe("/version", 20, 5, 3),
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
                "securityContext": _non_root(),
            }
        ],
        "volumes": [{"name": "artifacts-cache", "hostPath": {"path": CACHE_HOST_PATH, "type": "DirectoryOrCreate"}}],
    }
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    return _object(
        "apps/v1",
        "Deployment",
        settings,
        {
            "replicas": settings.replicas,
            "selector": {"matchLabels": _labels(settings)},
            # a new pod needs free Neuron resources before an old one goes
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": _labels(settings)}, "spec": pod},
        },
    )


def service(settings: Settings) -> dict:
    return _object(
        "v1",
        "Service",
        settings,
        {
            "type": "ClusterIP",
            "selector": _labels(settings),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    )


def autoscaler(settings: Settings) -> dict:
    return _object(
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        settings,
        {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": settings.name},
            "minReplicas": settings.replicas,
            "maxReplicas": max_replicas(settings),
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": f"{settings.target_waiting:g}"},
                    },
                }
            ],
            # a pod takes minutes to pull and load: one is not given back on a short lull
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
    )


def scrape_config(settings: Settings) -> dict:
    """A job for prometheus.yml's `scrape_configs`: this release's pods (by label), their `http` port."""
    return {
        "scrape_configs": [
            {
                "job_name": f"neuron-moe-{settings.name}",
                "metrics_path": "/metrics",
                "scrape_interval": "15s",
                "kubernetes_sd_configs": [{"role": "pod"}],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
                        "regex": settings.name,
                        "action": "keep",
                    },
                    {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http", "action": "keep"},
                    # the adapter maps these two labels to the objects the autoscaler asks about
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            }
        ]
    }


def adapter_rules() -> dict:
    """The Prometheus adapter's configuration (its Helm chart takes the list as `rules.custom`)."""
    return {
        "rules": [
            {
                "seriesQuery": f'{WAITING_METRIC}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{WAITING_METRIC}$", "as": HPA_METRIC},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }


def command_line(settings: Settings, tp: int) -> str:
    """The command that writes these files again (the TP degree as resolved)."""
    layers = settings.quantized_layers
    flags = [
        ("--model", settings.model),
        ("--instance", settings.instance),
        ("--artifacts", settings.artifacts),
        ("--quantization", settings.quantization),
        ("--quantized-layers", None if layers == DEFAULT_QUANTIZED_LAYERS else ",".join(layers)),
        ("--tp", tp),
        ("--resource", settings.resource),
        ("--replicas", settings.replicas),
        ("--max-replicas", settings.max_replicas),
        ("--target-waiting", f"{settings.target_waiting:g}"),
        ("--name", settings.name),
        ("--image", settings.image),
        ("--api-key-secret", settings.api_key_secret),
        ("--service-account", settings.service_account),
        ("--drain-timeout", f"{settings.drain_timeout:g}"),
    ]
    words = [str(w) for flag, value in flags if value is not None for w in (flag, value)]
    return shlex.join(["neuron-moe", "deploy", "k8s", *words]) + " --out DIR"


def _check(settings: Settings) -> None:
    for field in fields(settings):  # each lands in YAML and in the files' header comment: one word each
        value = getattr(settings, field.name)
        if isinstance(value, str) and (not value or any(c.isspace() or not c.isprintable() for c in value)):
            raise UserError(f"--{field.name.replace('_', '-')} {value!r}: empty, or a space or control character in it")
    if not NAME.fullmatch(settings.name):
        raise UserError(
            f"--name {settings.name!r}: lower-case letters, digits and '-', starting with a letter, at most 52"
        )
    for flag, value in (("--api-key-secret", settings.api_key_secret), ("--service-account", settings.service_account)):
        if value is not None and not SUBDOMAIN.fullmatch(value):
            raise UserError(f"{flag} {value!r}: not a Kubernetes object name (lower-case letters, digits, '-' and '.')")
    for flag, value in (("--replicas", settings.replicas), ("--max-replicas", settings.max_replicas)):
        if value is not None and not 1 <= value <= INT32_MAX:
            raise UserError(f"{flag} {value}: must be in [1, {INT32_MAX}] (an int32 in Kubernetes' schema)")
    if settings.max_replicas is not None and settings.max_replicas < settings.replicas:
        raise UserError(f"--max-replicas {settings.max_replicas} is below --replicas {settings.replicas}")
    if not 0 <= settings.drain_timeout <= MAX_DRAIN_S:
        raise UserError(f"--drain-timeout {settings.drain_timeout:g}: must be in [0, {MAX_DRAIN_S}] seconds (a day)")
    cache_dir(settings.artifacts)


def _dump(obj: dict, command: str) -> str:
    head = (
        f"# Written by neuron-moe {__version__}: {command}\n"
        "# Not run on a cluster: checked offline against Kubernetes' schemas only (docs/deploy.md).\n"
    )
    return head + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)


def write(settings: Settings, port, out: Path) -> dict:
    """Write the files to `out` (replaced whole, atomically; a directory holding other files is
    refused) and return the report. A symbolic link is written through: the folder it points to is
    replaced, the link kept, as a file output written through a link is."""
    _check(settings)
    out = Path(out)
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    check_output(target, directory=True)
    if target.is_dir():
        ours = set(FILES) | {"prometheus"}
        others = sorted(str(p.relative_to(target)) for p in target.rglob("*") if str(p.relative_to(target)) not in ours)
        if others:
            raise UserError(
                f"{out} holds files deploy k8s did not write ({', '.join(others[:3])}): choose another --out"
            )
    tp, plan = resolve_tp(port, settings.instance, settings.quantization, settings.tp, settings.quantized_layers)
    command = command_line(settings, tp)
    documents = {
        "deployment.yaml": deployment(settings, port, tp),
        "service.yaml": service(settings),
        "hpa.yaml": autoscaler(settings),
        "prometheus/scrape-config.yaml": scrape_config(settings),
        "prometheus/adapter-rules.yaml": adapter_rules(),
    }
    with atomic_dir(target) as tmp:
        (tmp / "prometheus").mkdir()
        for rel, obj in documents.items():
            (tmp / rel).write_text(_dump(obj, command))
    resource, count = neuron_resource(settings.resource, tp)
    return {
        "out": str(out),
        "files": list(FILES),
        "command": command,
        "model": port.name,
        "instance": settings.instance,
        "quantization": settings.quantization,
        "quantized_layers": list(settings.quantized_layers),
        "tp": tp,
        "tp_from": "--tp" if settings.tp is not None else "plan",
        "plan": {"fits": plan["fits"], "reason": plan["reason"], "per_rank_total_bytes": plan["per_rank_total_bytes"]},
        "resource": resource,
        "count": count,
        "pods_per_node": pods_per_node(settings.instance, settings.resource, count),
        "replicas": settings.replicas,
        "max_replicas": max_replicas(settings),
        "termination_grace_period_s": grace_period(settings),
        "drain_timeout_s": settings.drain_timeout,
    }


def render(report: dict) -> str:
    how = (
        "the artifact's, as given"
        if report["tp_from"] == "--tp"
        else f"the smallest degree whose plan fits {report['instance']}"
    )
    quantization = "" if report["quantization"] == "none" else f" --quantization {report['quantization']}"
    if quantization and tuple(report["quantized_layers"]) != DEFAULT_QUANTIZED_LAYERS:
        quantization += f" --quantized-layers {','.join(report['quantized_layers'])}"
    rows = [
        {"what": "TP degree", "value": f"{report['tp']}, {how} ({report['plan']['reason']})"},
        {"what": "per pod", "value": f"{report['count']} {report['resource']}"},
        {"what": "pods per node", "value": str(report["pods_per_node"])},
        {"what": "replicas", "value": f"{report['replicas']} to {report['max_replicas']} (the waiting-requests HPA)"},
        {
            "what": "grace period",
            "value": f"{report['termination_grace_period_s']} s (drain timeout {report['drain_timeout_s']:g} s)",
        },
    ]
    return "\n".join(
        [
            f"{report['model']} on {report['instance']}: wrote {', '.join(report['files'])} to {report['out']}\n",
            table(rows, [("what", "deploy k8s"), ("value", "")]),
            f"\nkubectl apply -f {report['out']}: the artifact must be built at TP {report['tp']} "
            f"(trace-and-compile --tp {report['tp']}{quantization}). Not run on a cluster (docs/deploy.md).",
        ]
    )
