"""compose.host.yaml: many models on one host from one file in one container (``memsvc up --config``
over examples/host.toml), checked by reading the files and by running the service's command as a plain
process (no container engine here).

What a container provides is rewritten the way tests/test_compose.py does: the file's ``0.0.0.0``
listen addresses become loopback free ports, its state directory (the state volume) a directory under
tmp_path. The run then: the service's health check passes, the gateway lists both models, a request
for each gets text through the OpenAI SDK, and ``docker compose stop`` (SIGTERM) ends it with exit 0
within the grace period.
"""

from __future__ import annotations

import os
import shlex
import signal
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from childproc import Proc
from test_compose import (
    dockerfile_stages,
    dotenv,
    entrypoint,
    environment,
    healthy,
    memsvc_argv,
    port_of,
    ports,
    volumes,
)
from upproc import REPO_ROOT, free_port, wait_for

from memsvc._host import load_host_config

openai = pytest.importorskip("openai")

COMPOSE_HOST = REPO_ROOT / "compose.host.yaml"
CONFIG_IN_CONTAINER = "/etc/memsvc/host.toml"


def services() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_HOST.read_text())
    assert isinstance(doc, dict)
    return dict(doc["services"])


def command(service: dict[str, Any]) -> list[str]:
    words = service["command"]
    return shlex.split(words) if isinstance(words, str) else list(words)


def the_host_file(service: dict[str, Any]) -> Path:
    """The file mounted where the command reads it, by default (no MEMSVC_HOST_FILE in .env)."""
    (src,) = [s for s, dst, mode in volumes(service, dotenv()) if dst == CONFIG_IN_CONTAINER and mode == "ro"]
    return REPO_ROOT / src


def test_both_profiles_run_memsvc_up_over_the_mounted_host_file() -> None:
    svc = services()
    assert {n: s["profiles"] for n, s in svc.items()} == {"host": ["gpu"], "host-cpu": ["cpu"]}
    assert dotenv()["COMPOSE_PROFILES"] == "gpu", "the .env beside it starts the GPU service"
    (gpu,) = svc["host"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == "all", "one container for every GPU of the host"
    for name, s in svc.items():
        assert command(s) == ["up", "--config", CONFIG_IN_CONTAINER], name
        assert the_host_file(s) == REPO_ROOT / "examples" / "host.toml", name
        assert s["stop_signal"] == "SIGTERM" and s["restart"] == "unless-stopped" and s["init"] is True
        assert s["ulimits"]["memlock"] == -1, f"{name}: the workers page-lock host memory for their sleeps"


def test_the_example_host_file_matches_the_ports_and_volumes() -> None:
    cfg = load_host_config(REPO_ROOT / "examples" / "host.toml")
    assert [(m.name, m.model) for m in cfg.models] == [("small-a", "synthetic:small"), ("small-b", "synthetic:small")]
    for name, s in services().items():
        published = ports(s)
        for listen in (cfg.gateway_listen, cfg.manager_listen, cfg.metrics_listen):
            assert listen.startswith("0.0.0.0:"), f"{listen}: not reachable from outside the container"
            assert port_of(listen) in published, f"{name} does not publish {listen}"
        targets = {dst: src for src, dst, _ in volumes(s, dotenv())}
        assert targets.get(cfg.state_dir) == "memsvc-state", f"{name}: the manager's database on a named volume"
        hf_home = environment(s, dotenv())["HF_HOME"]
        assert targets.get(hf_home) == "hf-cache", f"{name}: Hub downloads kept across restarts"
        chowned = [i for i in dockerfile_stages()["runtime"] if "chown memsvc" in i]
        for dst in (cfg.state_dir, hf_home):  # a named volume takes the image's owner of its mount point
            assert any(dst in i.split("chown memsvc", 1)[1] for i in chowned), f"{dst}: not the service user's"
        assert s["healthcheck"]["test"] == [
            "CMD",
            "memsvc",
            "health",
            f"http://127.0.0.1:{port_of(cfg.gateway_listen)}/health",
        ]


def test_the_cpu_service_serves_both_models_and_stops_cleanly(tmp_path: Path) -> None:
    svc = services()["host-cpu"]
    raw = tomllib.loads(the_host_file(svc).read_text())
    in_container = f"127.0.0.1:{port_of(raw['gateway']['listen'])}"  # where the health check dials
    gateway = f"127.0.0.1:{free_port()}"
    raw["manager"].update(listen=f"127.0.0.1:{free_port()}", metrics_listen="", state_dir=str(tmp_path / "state"))
    raw["gateway"]["listen"] = gateway
    local = tmp_path / "host.yaml"  # the same tables, as YAML: the file may be either
    local.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSVC_")}  # a container has none of ours
    env.update(environment(svc, dotenv()), HF_HOME=str(tmp_path / "hf-cache"), HF_HUB_OFFLINE="1")
    argv = [*entrypoint(), *command(svc)]
    argv[argv.index(CONFIG_IN_CONTAINER)] = str(local)
    with Proc(memsvc_argv(argv), env=env, name="memsvc up (compose host-cpu)").start() as proc:
        healthy("host-cpu", [w.replace(in_container, gateway) for w in svc["healthcheck"]["test"]], proc)
        client = openai.OpenAI(base_url=f"http://{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
        # the models load one after the other, the gateway serving before the second is in
        wait_for(
            lambda: sorted(m.id for m in client.models.list().data),
            lambda ids: ids == ["small-a", "small-b"],
            what="both models listed",
            timeout=120,
        )
        for model in ("small-a", "small-b", "small-a"):
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
            )
            assert r.choices[0].message.content, f"{model} answered no text"
        grace = float(str(svc["stop_grace_period"]).removesuffix("s"))
        assert proc.signal_and_wait(signal.SIGTERM, timeout=grace) == 0, proc.failure("memsvc up on SIGTERM")
