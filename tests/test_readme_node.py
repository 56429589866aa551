"""The README's Node.js client ("Clients in other languages"), run as written against real managers.

The ``js`` block of that section is written to a file and run with node from the repository root (it
loads ``protos/``), with only the manager's address (127.0.0.1:50051) replaced. It must print what
the README says it prints: the worker's state; NOT_FOUND with the ErrorInfo decoded from the
``grpc-status-details-bin`` trailer for a worker the manager does not know; UNAUTHENTICATED without
the token. A second script asks the manager's reflection over ``grpc.reflection.v1`` with grpc-js and
the v1 reflection.proto that @grpc/reflection ships: a client that speaks only v1.

Needs node and npm (the npm packages are installed into a temporary directory once per session);
skipped where either is missing or the npm registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from managerproc import Cluster, ManagerProcess
from workerproc import REPO_ROOT

README = REPO_ROOT / "README.md"
README_MANAGER = "127.0.0.1:50051"
SECTION = "## Clients in other languages"
PACKAGES = ["@grpc/grpc-js@1", "@grpc/proto-loader@0.8", "protobufjs@7", "@grpc/reflection@1"]
TOKEN = "node-client-token"
TIMEOUT = 60

NODE, NPM = shutil.which("node"), shutil.which("npm")
pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="needs node and npm")


def readme_snippet() -> str:
    text = README.read_text()
    assert SECTION in text, f"README has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```js\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) == 1, f"expected one js block in {SECTION!r}, found {len(blocks)}"
    snippet: str = blocks[0]
    assert README_MANAGER in snippet
    return snippet


def readme_says(output: str) -> None:
    """The README states this output of the snippet (up to the ``…`` it elides)."""
    assert f"`{output}`" in " ".join(README.read_text().split()), f"README does not say `{output}`"


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert NPM is not None
    d = tmp_path_factory.mktemp("node")
    (d / "package.json").write_text('{"private": true}\n')
    try:
        r = subprocess.run(
            [NPM, "install", "--no-audit", "--no-fund", "--ignore-scripts", *PACKAGES],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("npm install timed out (no npm registry?)")
    if r.returncode != 0:
        pytest.skip(f"npm install failed (no npm registry?): {r.stderr[-500:]}")
    return d


def node(node_dir: Path, name: str, source: str, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``source`` as node_dir/name (so it finds node_modules) from the repository root."""
    assert NODE is not None
    script = node_dir / name
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "MEMSVC_TOKEN"}
    if token:
        env["MEMSVC_TOKEN"] = token
    return subprocess.run(
        [NODE, str(script), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cl = Cluster(tmp_path_factory.mktemp("node-managers"))
    try:
        yield cl
    finally:
        cl.close()


@pytest.fixture(scope="module")
def manager(cluster: Cluster) -> ManagerProcess:
    """A plain manager with the README's worker, local0."""
    mp = cluster.manager(db=cluster.tmp_path / "plain.db")
    cluster.workers_up(mp, ["local0"])
    return mp


@pytest.fixture(scope="module")
def tokened(cluster: Cluster) -> ManagerProcess:
    """A manager that wants a token and knows no worker."""
    (cluster.tmp_path / "token").write_text(TOKEN + "\n")
    return cluster.manager(["--token-file", str(cluster.tmp_path / "token")], db=cluster.tmp_path / "tokened.db")


def test_the_readme_snippet_gets_the_worker(node_dir: Path, manager: ManagerProcess) -> None:
    r = node(node_dir, "readme.js", readme_snippet().replace(README_MANAGER, manager.address))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "workers/local0 WORKER_STATE_AWAKE", r.stdout
    readme_says(r.stdout.strip())


def test_the_readme_snippet_decodes_the_error_info(node_dir: Path, tokened: ManagerProcess) -> None:
    source = readme_snippet().replace(README_MANAGER, tokened.address)
    r = node(node_dir, "readme.js", source, token=TOKEN)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.strip() == 'NOT_FOUND NOT_FOUND memsvc.dev {"name":"workers/local0"}', r.stdout + r.stderr
    readme_says(r.stdout.strip())
    for token in ("", "wrong-token"):
        r = node(node_dir, "readme.js", source, token=token)
        assert r.returncode == 1, (r.stdout, r.stderr)
        line = r.stdout.strip()
        assert (
            line == 'UNAUTHENTICATED UNAUTHENTICATED memsvc.dev {"method":"/memsvc.v1.MemoryManagerService/GetWorker"}'
        )
        readme_says(line.split("{", 1)[0] + "{…}")


REFLECT_V1 = r"""
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const descriptor = require("protobufjs/ext/descriptor");
const path = require("path");

const [address, ...symbols] = process.argv.slice(2);
const proto = path.join(path.dirname(require.resolve("@grpc/reflection/package.json")),
                        "build/proto/grpc/reflection/v1/reflection.proto");
const def = protoLoader.loadSync(proto, { keepCase: true, longs: String, enums: String, oneofs: true });
const v1 = grpc.loadPackageDefinition(def).grpc.reflection.v1;
const call = new v1.ServerReflection(address, grpc.credentials.createInsecure()).ServerReflectionInfo();
const out = [];
call.on("data", (resp) => {
  if (resp.message_response === "list_services_response") {
    out.push({ services: resp.list_services_response.service.map((s) => s.name).sort() });
  } else if (resp.message_response === "file_descriptor_response") {
    const files = resp.file_descriptor_response.file_descriptor_proto
      .map((b) => descriptor.FileDescriptorProto.decode(b))
      .map((f) => ({ name: f.name, services: (f.service || []).map((s) => `${f.package}.${s.name}`) }));
    out.push({ files });
  } else {
    out.push({ error: resp.error_response.error_code });
  }
  if (out.length === 1 + symbols.length) call.end();
});
call.on("error", (e) => { console.error(e.message); process.exitCode = 2; });
call.on("end", () => console.log(JSON.stringify(out)));
call.write({ list_services: "" });
for (const s of symbols) call.write({ file_containing_symbol: s });
"""


def test_a_v1_only_reflection_client(node_dir: Path, manager: ManagerProcess) -> None:
    served, other = "memsvc.v1.MemoryManagerService", "memsvc.v1.ModelWorkerService"
    r = node(node_dir, "reflect_v1.js", REFLECT_V1, manager.address, served, other)
    assert r.returncode == 0, r.stderr
    listed, described, missing = json.loads(r.stdout)
    assert listed == {
        "services": sorted(
            [
                served,
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            ]
        )
    }
    files = {f["name"]: f["services"] for f in described["files"]}
    assert files["memsvc/v1/memory_manager_service.proto"] == [served]
    assert files["memsvc/v1/model_worker_service.proto"] == []  # imported for its messages, service left out
    assert {"memsvc/v1/common.proto", "google/protobuf/timestamp.proto"} <= set(files)
    assert missing == {"error": 5}  # NOT_FOUND
