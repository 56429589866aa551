"""deploy/kubernetes: a kustomize base (manager, workers, gateway) and overlays, rendered as
operators render them (``kubectl kustomize``: Debian's kubectl, which the Makefile puts in .venv/bin)
and checked:

- every object against the Kubernetes API's schemas (``kubernetes-validate``, strict: no unknown
  field), for the oldest and newest releases the manifests claim (1.27: native gRPC probes are GA
  since 1.27; and 1.33);
- every object what memsvc needs of it: each container's command is a memsvc command, its MEMSVC_*
  variables are ones that command reads, a gRPC probe names the service the process serves, probes
  and Services point at ports the containers declare, each worker asks for one GPU and registers
  under its pod's name and address, and the two models' StatefulSets and Services select apart;
- the Prometheus operator's ServiceMonitors (no schema in the API's) scrape the ports and paths the
  manager and the gateway serve, with the token's secret.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from memsvc import cli
from memsvc._host import ADVERTISE_HOST_VAR, ID_PREFIX_VAR, load_host_config

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBE = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("one-gpu", "two-models", "monitoring", "ha", "mtls", "many-models")
VERSIONS = ("1.27", "1.33")
SERVICES = {
    "manager": "memsvc.v1.MemoryManagerService",
    "worker": "memsvc.v1.ModelWorkerService",
}


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert found, "kubectl is missing: `make test` puts Debian's in .venv/bin"
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def variables(command: str) -> set[str]:
    """The MEMSVC_* variables ``memsvc <command>`` reads (its flags' defaults); for ``up --config``,
    its own and those of the workers it starts, which read its environment."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[command]._actions
    own = {str(a.default.variable) for a in actions if getattr(a.default, "variable", None)}
    return own | variables("worker") | {ADVERTISE_HOST_VAR, ID_PREFIX_VAR} if command == "up" else own


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    """Whether ``selector`` picks ``workload``'s pods."""
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def containers(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (o, c)
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_the_kubernetes_schemas(overlay: str) -> None:
    objects = render(overlay)
    assert objects
    for version in VERSIONS:
        for obj in objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: checked below
            kubernetes_validate.validate(obj, version, strict=True)


def volumes_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_process_is_configured_as_memsvc_reads_it(overlay: str) -> None:
    objects = render(overlay)
    for obj, c in containers(objects):
        command = c["args"][0]
        assert command in ("manager", "worker", "gateway", "up") and c["image"].startswith("memsvc"), c
        names = {e["name"] for e in c["env"]}
        unknown = {n for n in names if n.startswith("MEMSVC_")} - variables(command)
        assert not unknown, f"{obj['metadata']['name']}: memsvc {command} reads no {sorted(unknown)}"
        if command == "up":
            continue  # a pod of many models: test_many_models_pods_run_the_host_file_against_one_manager
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["MEMSVC_TOKEN_FILE"] == "/etc/memsvc/token/token"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        tls = {k: v for k, v in env.items() if k.startswith("MEMSVC_TLS_")}
        for name, path in tls.items():  # each file from the mounted secret
            assert path and mounts.get("tls") and path.startswith(mounts["tls"] + "/"), (name, path)
            assert volumes_of(obj)["tls"]["secret"]["secretName"] == "memsvc-tls"
        if "MEMSVC_TLS_CERT" in tls and "grpc" in c.get("readinessProbe", {}):
            raise AssertionError("a TLS server's kubelet gRPC probe cannot connect")
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        assert set(mounts) <= set(volumes) | claims, (mounts, volumes)
        assert volumes["token"]["secret"]["secretName"] == "memsvc-token" and mounts["token"] == "/etc/memsvc/token"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "grpc" in probe:
                assert probe["grpc"]["port"] in ports.values()
                assert probe["grpc"].get("service", SERVICES[command]) in ("", SERVICES[command])
            elif "exec" in probe:  # with mTLS: `memsvc health` shows the container's client certificate
                argv = probe["exec"]["command"]
                assert argv[:2] == ["memsvc", "health"] and argv[2] == f"localhost:{ports['grpc']}", argv
                assert argv[3:] in ([], ["--service", SERVICES[command]]), argv
                assert {"MEMSVC_TLS_CA", "MEMSVC_TLS_CLIENT_CERT", "MEMSVC_TLS_CLIENT_KEY"} <= set(env), (
                    "its certificate"
                )
                assert probe["timeoutSeconds"] >= 5, "a Python process needs more than the kubelet's 1 s"
                assert "grpc" not in probe
            else:
                assert probe["httpGet"]["port"] in ports and probe["httpGet"]["path"] in ("/healthz", "/readyz")
        if command == "manager" and "state" in mounts:  # one manager on its SQLite file
            assert env["MEMSVC_DB"].startswith(mounts["state"]) and obj["spec"]["replicas"] == 1
        if command == "manager" and "state" not in mounts:  # replicas on PostgreSQL (overlays/ha)
            db = next(e for e in c["env"] if e["name"] == "MEMSVC_DB")
            assert db["valueFrom"]["secretKeyRef"] == {"name": "memsvc-db", "key": "url"} and "value" not in db
            assert obj["spec"]["replicas"] >= 2 and "volumeClaimTemplates" not in obj["spec"]
            assert env["MEMSVC_ADVERTISE"] == f"$(POD_IP):{ports['grpc']}"
            assert [e["name"] for e in c["env"]].index("POD_IP") < [e["name"] for e in c["env"]].index(
                "MEMSVC_ADVERTISE"
            ), "a $(VAR) reference needs VAR earlier in the list"
            assert c["readinessProbe"]["grpc"]["service"] == SERVICES["manager"], "only the leader is ready"
        if command == "manager":
            assert env["MEMSVC_MANAGER_LISTEN"].endswith(f":{ports['grpc']}")
            assert env["MEMSVC_METRICS_LISTEN"].endswith(f":{ports['metrics']}")
        if command == "worker":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and env["MEMSVC_DEVICE"] == "0"
            assert env["MEMSVC_WORKER_ID"] == "$(POD_NAME)"
            advertised = {
                f"$(POD_IP):{ports['grpc']}",
                f"$(POD_NAME).{obj['spec']['serviceName']}.$(POD_NAMESPACE).svc.cluster.local:{ports['grpc']}",
            }
            assert env["MEMSVC_ADVERTISE"] in advertised, "an address the manager reaches (by DNS name with TLS)"
            assert env["MEMSVC_WORKER_LISTEN"].endswith(f":{ports['grpc']}")
            assert env["MEMSVC_MANAGER"] == "memsvc-manager:50051"
            assert env["MEMSVC_OFFLOAD_DIR"] == mounts["offload"]
        if command == "gateway":
            assert env["MEMSVC_GATEWAY_LISTEN"].endswith(f":{ports['http']}")
            assert env["MEMSVC_MANAGER"] == "memsvc-manager:50051"
    # every Service selects the pods of one workload, at ports they declare
    services = [o for o in objects if o["kind"] == "Service"]
    for svc in services:
        chosen = [(o, c) for o, c in containers(objects) if selects(svc["spec"]["selector"], o)]
        assert len({o["metadata"]["name"] for o, _ in chosen}) == 1, svc["metadata"]["name"]
        declared = {p["name"] for _, c in chosen for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= declared
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            assert obj["spec"]["serviceName"] in {s["metadata"]["name"] for s in services}
            assert selects(obj["spec"]["selector"]["matchLabels"], obj)


def test_two_models_are_two_worker_sets_with_their_own_model() -> None:
    objects = render("two-models")
    models = {
        o["metadata"]["name"]: {e["name"]: e.get("value") for e in c["env"]}["MEMSVC_MODEL"]
        for o, c in containers(objects)
        if c["args"] == ["worker"]
    }
    assert models == {"memsvc-worker": "synthetic:1b", "memsvc-worker-qwen": "Qwen/Qwen2.5-0.5B-Instruct"}
    assert all(o["metadata"].get("namespace") == "memsvc" for o in objects)


def test_the_service_monitors_scrape_what_the_manager_and_gateway_serve() -> None:
    objects = render("monitoring")
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"memsvc-manager", "memsvc-gateway"}
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for name, mon in monitors.items():
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        assert mon["spec"]["selector"]["matchLabels"].items() <= services[name]["metadata"]["labels"].items()
        (endpoint,) = mon["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in services[name]["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        assert endpoint["authorization"]["credentials"] == {"name": "memsvc-token", "key": "token"}


def test_many_models_pods_run_the_host_file_against_one_manager(tmp_path: Path) -> None:
    """overlays/many-models: pods of ``memsvc up --config`` whose file, as the ConfigMap mounts it, loads
    (with the pod's IP and name as the Downward API gives them) into workers that register with the
    manager of base/manager at ports the pod declares and its headless Service names."""
    objects = render("many-models")
    (host,) = [(o, c) for o, c in containers(objects) if c["args"][0] == "up"]
    obj, c = host
    assert c["args"][:2] == ["up", "--config"]
    path = Path(c["args"][2])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    volume = volumes_of(obj)[mounts[str(path.parent)]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"], "the generated name, hash included"
    file = tmp_path / path.name
    file.write_text(config_map["data"][path.name])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[ADVERTISE_HOST_VAR] == "$(POD_IP)" and env[ID_PREFIX_VAR] == "$(POD_NAME)"
    cfg = load_host_config(file, {ADVERTISE_HOST_VAR: "10.1.2.3", ID_PREFIX_VAR: "memsvc-host-0"})
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    manager_host, _, manager_port = cfg.manager_address.partition(":")
    assert int(manager_port) in {p["port"] for p in services[manager_host]["spec"]["ports"]}
    assert cfg.gateway_listen == "", "base/gateway serves the pods' models"
    declared = {p["containerPort"] for p in c["ports"]}
    headless = {p["port"] for p in services[obj["spec"]["serviceName"]]["spec"]["ports"]}
    assert services[obj["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    for model in cfg.models:
        port = int(model.listen.rpartition(":")[2])
        assert model.listen.startswith("0.0.0.0:") and port in declared and port in headless, model
        assert model.advertise == f"10.1.2.3:{port}" and model.worker_id.startswith("memsvc-host-0-"), model
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in (c["startupProbe"], c["livenessProbe"]):
        assert probe["grpc"]["port"] in declared
