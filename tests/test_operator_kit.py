"""The operator kit in deploy/: Prometheus rules (deploy/prometheus) and a Grafana dashboard
(deploy/grafana), checked as an operator's tools would, and against what memsvc really exposes:

- ``promtool check rules`` on the rules file and on every dashboard query (each made a recording
  rule, Grafana's ``$__rate_interval`` as 5m), and ``promtool test rules`` on the alerts' unit tests;
- every ``memsvc_*`` series the rules and the dashboard name is one that a real manager (a worker
  registered, a sleep and a wake done) or gateway (a request served) exposes at ``/metrics``.

promtool is Debian's (the ``prometheus`` package's binary, which the Makefile puts in .venv/bin).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml
from gatewayproc import GatewayProcess
from managerproc import ManagerProcess, wait_for
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb

REPO_ROOT = Path(__file__).resolve().parent.parent
RULES = REPO_ROOT / "deploy" / "prometheus" / "memsvc-rules.yaml"
RULE_TESTS = REPO_ROOT / "deploy" / "prometheus" / "memsvc-rules.test.yaml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "memsvc-dashboard.json"
SERIES = re.compile(r"\bmemsvc_[a-z_]+")


def promtool() -> str:
    found = shutil.which("promtool", path=str(Path(sys.executable).parent)) or shutil.which("promtool")
    assert found, "promtool is missing: `make test` puts Debian's in .venv/bin"
    return found


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def rule_queries() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def test_the_rules_and_their_unit_tests_pass_promtool() -> None:
    for argv in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run([promtool(), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert all(r["labels"]["severity"] and r["annotations"]["summary"] for r in alerts)


def test_every_dashboard_query_is_promql_and_each_panel_has_a_title_and_unit(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "memsvc" and dash["templating"]["list"][0]["type"] == "datasource"
    for panel in dash["panels"]:
        assert panel["title"] and panel["fieldConfig"]["defaults"]["unit"] and panel["targets"], panel
    rules = [
        {"record": f"dashboard:query_{i}", "expr": q.replace("$__rate_interval", "5m")}
        for i, q in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def exposed(text: str) -> set[str]:
    """The sample names a /metrics text can hold, from its TYPE lines (a histogram's _bucket, _sum and
    _count; a labelled family is typed before it has any sample)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def test_every_series_the_kit_names_is_one_memsvc_exposes(tmp_path: Path) -> None:
    named = {s for q in (*rule_queries(), *dashboard_queries()) for s in SERIES.findall(q)}
    assert "memsvc_worker_info" in named and "memsvc_gateway_unleased_total" in named
    mp = ManagerProcess(tmp_path / "manager.db", metrics=True).start()
    wp = WorkerProcess(["--manager", mp.address, "--worker-id", "kit"])
    gw = None
    try:
        wp.start()
        listed = lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers  # noqa: E731
        wait_for(
            listed, lambda ws: any(x.state == common_pb.WORKER_STATE_AWAKE for x in ws), what="registration", timeout=60
        )
        mp.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/kit"), timeout=60)
        mp.stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/kit"), timeout=60)
        gw = GatewayProcess(mp.address).start()
        body = json.dumps({"model": "synthetic:tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        post = urllib.request.Request(f"{gw.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=60) as r:
            assert r.status == 200
        have = exposed(scrape(mp.metrics_url)) | exposed(scrape(f"{gw.url}/metrics"))
        assert named <= have, f"named by deploy/ but not exposed: {sorted(named - have)}"
    finally:
        if gw is not None:
            gw.kill()
        wp.kill()
        mp.kill()
