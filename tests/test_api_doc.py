"""The docs stay in step with the code: docs/api.md is exactly what docs/gen_api.py makes of the protos
today, and docs/operations.md's config examples, policy fields and metrics are the ones the manager
has (its examples are parsed by memsvc.manager.config.load_config)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from upproc import REPO_ROOT

from memsvc.manager.config import ManagerConfig, load_config
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import FIELDS
from memsvc.manager.settings import ManagerSettings
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

DOCS = REPO_ROOT / "docs"
API_MD = DOCS / "api.md"
OPERATIONS_MD = DOCS / "operations.md"


def gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh() -> str:
    return str(gen_api().render())


def test_api_md_is_generated_from_the_protos(fresh: str) -> None:
    committed = API_MD.read_text() if API_MD.is_file() else ""
    if committed != fresh:
        diff = difflib.unified_diff(
            committed.splitlines(),
            fresh.splitlines(),
            "docs/api.md (committed)",
            "docs/api.md (from the protos)",
            n=1,
            lineterm="",
        )
        pytest.fail(
            "docs/api.md is out of step with protos/memsvc/v1. Regenerate it with\n\n"
            f"    {gen_api().REGENERATE}\n\nand commit the result. The difference:\n" + "\n".join(list(diff)[:60])
        )


def test_generation_is_deterministic(fresh: str) -> None:
    assert gen_api().render() == fresh


def test_api_md_covers_every_rpc_message_and_enum(fresh: str) -> None:
    for module in (common_pb, manager_pb, worker_pb):
        fd = module.DESCRIPTOR
        for svc in fd.services_by_name.values():
            assert f"### {svc.name}\n" in fresh
            for md in svc.methods:
                assert re.search(rf"^\| `{md.name}` \| .*{md.input_type.name}.*{md.output_type.name}", fresh, re.M)
        for msg in fd.message_types_by_name.values():
            assert f"### {msg.name}\n" in fresh
            for field in msg.fields:
                assert f"| `{field.name}` |" in fresh, f"{msg.name}.{field.name}"
        for enum in fd.enum_types_by_name.values():
            assert f"### {enum.name}\n" in fresh
            for value in enum.values:
                assert f"| `{value.name}` | {value.number} |" in fresh


def test_comments_reach_the_reference(fresh: str) -> None:
    """Spot checks: a service, an RPC, a field and an enum value keep their proto comments."""
    assert "The manager: knows every worker, the tag policy" in fresh
    assert "| `AcquireWorker` |" in fresh and "keep it awake while the lease lives." in fresh
    assert "| `idle_since_time` |" in fresh and "When the worker last became idle" in fresh
    assert "| `TAG_ACTION_OFFLOAD` | 1 | Copy to page-locked host memory" in fresh
    assert "| `tag_actions` | map<`string`, [`TagAction`](#tagaction)> |" in fresh
    assert "stream [`WatchWorkersResponse`](#watchworkersresponse)" in fresh


# ---- docs/operations.md ----
def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", OPERATIONS_MD.read_text(), re.S | re.M)


def example_configs(tmp_path: Path) -> list[ManagerConfig]:
    out = []
    for lang, suffix in (("toml", ".toml"), ("yaml", ".yaml")):
        for i, block in enumerate(code_blocks(lang)):
            path = tmp_path / f"example{i}{suffix}"
            path.write_text(block)
            out.append(load_config(path))
    return out


def test_operations_config_examples_load(tmp_path: Path) -> None:
    assert code_blocks("toml") and code_blocks("yaml"), "operations.md shows the config file in TOML and YAML"
    for cfg in example_configs(tmp_path):
        assert cfg.settings.heartbeat_interval == 2.0 and cfg.settings.default_lease_ttl == 60.0
        assert cfg.policy_fields["idle_sleep_timeout"] == 300.0
        assert cfg.policy_fields["idle_deep_sleep_timeout"] == 3600.0
        assert cfg.policy_fields["host_budget_bytes"] == 256 << 30
        assert cfg.policy_fields["tag_actions"] == {
            "weights": common_pb.TAG_ACTION_OFFLOAD,
            "kv_cache": common_pb.TAG_ACTION_DISCARD,
        }
        assert [(sw.worker_id, sw.address, sw.host, sw.configured) for sw in cfg.workers] == [
            ("gpu0", "10.0.0.7:50061", "gpu-host-1", True)
        ]


def test_operations_host_file_example_loads(tmp_path: Path) -> None:
    """The "One host, many models" example is a host file ``memsvc up --config`` takes as written."""
    from memsvc._host import load_host_config

    (block,) = code_blocks("toml host")
    path = tmp_path / "host.toml"
    path.write_text(block)
    cfg = load_host_config(path)
    assert [(x.worker_id, x.model, x.name) for x in cfg.models] == [
        ("Qwen-Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", ""),
        ("llama", "/models/Llama-3.1-8B-Instruct", "llama"),
    ]
    assert cfg.models[1].args == ("--kv-blocks", "4096") and cfg.models[1].policy == {"time_slice": 5.0}
    assert cfg.policy["time_slice"] == 2.0 and cfg.policy["idle_deep_sleep_timeout"] == 3600.0


def test_operations_toml_example_documents_every_setting(tmp_path: Path) -> None:
    (toml,) = code_blocks("toml")
    keys = set(re.findall(r"^(\w+)\s*=", toml, re.M))
    settings = {f.name for f in dataclasses.fields(ManagerSettings)}
    assert settings <= keys, f"[manager] settings missing from the example: {sorted(settings - keys)}"
    assert set(FIELDS) <= keys, f"policy fields missing from the example: {sorted(set(FIELDS) - keys)}"
    path = tmp_path / "full.toml"
    path.write_text(toml)
    assert load_config(path).settings == ManagerSettings(), "the example shows the defaults"


def test_operations_policy_table_names_every_policy_field() -> None:
    text = OPERATIONS_MD.read_text()
    for f in FIELDS:
        assert f"| `{f}` |" in text, f


def test_operations_metrics_table_is_the_manager_metrics() -> None:
    registered = set()
    for fam in ManagerMetrics().registry.collect():
        registered.add(fam.name + {"counter": "_total", "info": "_info"}.get(fam.type, ""))
    documented = set(re.findall(r"^\| `(memsvc_\w+)` \|", OPERATIONS_MD.read_text(), re.M))
    assert documented == registered, (
        f"missing {sorted(registered - documented)}, extra {sorted(documented - registered)}"
    )


def test_error_details_document_every_reason_and_metadata_key() -> None:
    """docs/operations.md, "Error details": every ErrorInfo reason memsvc.errors defines and every
    metadata key the services put in one (found in the sources) is in its table."""
    import inspect

    from memsvc import errors

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "operations.md").read_text()
    table = doc.split("## Error details", 1)[1].split("\n## ", 1)[0]
    reasons = {
        cls.reason
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.MemsvcError) and cls is not errors.RelayedError
    }
    missing = {r for r in reasons if f"| `{r}` |" not in table}
    assert not missing, f"reasons missing from docs/operations.md's Error details: {sorted(missing)}"
    keys: set[str] = set()
    for path in [*root.glob("memsvc/**/*.py"), *root.glob("worker/**/*.py")]:
        if "/v1/" in str(path):
            continue
        for found in re.finditer(r"metadata=\{([^}]*)\}", path.read_text(), re.S):
            keys |= set(re.findall(r'"(\w+)":', found.group(1)))
    keys.discard("format")  # safetensors' own file metadata (weights.py), not an ErrorInfo
    undocumented = {k for k in keys if f"`{k}`" not in table}
    assert not undocumented, f"ErrorInfo metadata keys missing from Error details: {sorted(undocumented)}"
