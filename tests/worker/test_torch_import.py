"""worker/torch_import.py: torch imported without its Python meta registrations, which come, whole and
in torch's order, the moment anything asks for them. Each case in a fresh interpreter (an import is
once per process), against a plain ``import torch`` in another."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from childproc import REPO_ROOT

from worker.torch_import import BROUGHT, DEFERRED

REGISTRATIONS = (
    "import torch, torch._decomp\n"
    "names = torch._C._dispatch_get_all_op_names()\n"
    "meta = sorted(n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, 'Meta'))\n"
    "state = [len(names), meta, sorted(map(str, torch._decomp.decomposition_table)), "
    "sorted(map(str, torch._decomp.meta_table))]\n"
)
"""Python that sets ``state``: the operators, those with a meta kernel, and torch's decomposition and
meta tables, once the registrations are in (importing ``torch._decomp`` brings them either way)."""


def _run(code: str) -> Any:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def plain_registrations() -> object:
    return _run(REGISTRATIONS + "import json; print(json.dumps(state))")


def test_torch_imports_without_the_registrations_and_computes() -> None:
    code = (
        "import json, sys\n"
        "from worker.torch_import import import_torch, _RegistrationsFirst\n"
        "deferred = import_torch()\n"
        "import torch\n"
        "brought = sorted(n for n in sys.modules if n.startswith(('torch._decomp', 'torch._refs')))\n"
        "finders = sum(isinstance(f, _RegistrationsFirst) for f in sys.meta_path)\n"
        "x = torch.arange(12, dtype=torch.float32).view(3, 4)\n"
        f"print(json.dumps([deferred, {DEFERRED!r} in sys.modules, hasattr(torch, '_meta_registrations'), brought, "
        "finders, (x @ x.T).tolist()]))\n"
    )
    deferred, in_modules, attribute, brought, finders, product = _run(code)
    assert deferred is True
    assert (in_modules, attribute, brought) == (False, False, [])
    assert finders == 1
    assert product == [[14.0, 38.0, 62.0], [38.0, 126.0, 214.0], [62.0, 214.0, 366.0]]


@pytest.mark.parametrize("first", sorted(BROUGHT | {"torch._decomp.decompositions", "torch._refs.nn.functional"}))
def test_whichever_module_comes_first_the_registrations_come_whole(first: str, plain_registrations: object) -> None:
    """Imported on its own, ``torch._decomp`` (or ``torch._refs``, ``torch._prims``) fails half-made
    or registers twice: the finder must import the registrations first, once, and leave every module
    as a plain import leaves it (its own spec and loader), then step off ``sys.meta_path``."""
    code = (
        "import importlib, json, sys\n"
        "from worker.torch_import import import_torch, _RegistrationsFirst\n"
        "assert import_torch()\n"
        f"importlib.import_module({first!r})\n"
        + REGISTRATIONS
        + "specs = [getattr(m, '__spec__', None) for n, m in sys.modules.items() if n.startswith('torch')]\n"
        "loaders = sorted({type(s.loader).__name__ for s in specs if s is not None})\n"
        "finders = sum(isinstance(f, _RegistrationsFirst) for f in sys.meta_path)\n"
        f"print(json.dumps([state, torch._meta_registrations is sys.modules[{DEFERRED!r}], loaders, finders]))\n"
    )
    state, bound, loaders, finders = _run(code)
    assert state == plain_registrations
    assert bound is True
    assert "_Loaded" not in loaders
    assert finders == 0


def test_tracing_works_after_a_deferred_import() -> None:
    """What the registrations are for: fake tensors (shapes without data) and torch.compile."""
    code = (
        "import json\n"
        "from worker.torch_import import import_torch\n"
        "assert import_torch()\n"
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "with FakeTensorMode():\n"
        "    shape = list((torch.empty(3, 4) @ torch.empty(4, 5)).shape)\n"
        "compiled = torch.compile(lambda a: a * 2 + 1, backend='eager')\n"
        "meta = list((torch.empty(2, 3, device='meta') @ torch.empty(3, 7, device='meta')).shape)\n"
        "print(json.dumps([shape, compiled(torch.ones(2)).tolist(), meta]))\n"
    )
    assert _run(code) == [[3, 5], [3.0, 3.0], [2, 7]]


def test_nothing_changes_where_torch_was_imported_already() -> None:
    code = (
        "import json, sys, torch\n"
        "from worker.torch_import import import_torch, _RegistrationsFirst\n"
        "deferred = import_torch()\n"
        f"print(json.dumps([deferred, torch._meta_registrations is sys.modules[{DEFERRED!r}], "
        "any(isinstance(f, _RegistrationsFirst) for f in sys.meta_path)]))\n"
    )
    assert _run(code) == [False, True, False]


def test_a_torch_that_reads_the_stand_in_during_its_import_gets_the_real_module(plain_registrations: object) -> None:
    """A later torch might use the module inside its own import: the stand-in imports the real one
    then, and the import ends as a plain one does (no saving, nothing missing, no finder left)."""
    code = (
        "import importlib, json, sys\n"
        "import worker.torch_import as ti\n"
        "real_import = importlib.import_module\n"
        "def reading(name, *args):\n"  # torch's own import, then a read of the stand-in inside it
        "    module = real_import(name, *args)\n"
        "    if name == 'torch':\n"
        "        module._meta_registrations.activate_meta  # noqa\n"
        "    return module\n"
        "ti.importlib.import_module = reading\n"
        "deferred = ti.import_torch()\n"
        "ti.importlib.import_module = real_import\n"
        + REGISTRATIONS
        + "finders = sum(isinstance(f, ti._RegistrationsFirst) for f in sys.meta_path)\n"
        f"print(json.dumps([deferred, state, torch._meta_registrations is sys.modules[{DEFERRED!r}], finders]))\n"
    )
    deferred, state, bound, finders = _run(code)
    assert deferred is False
    assert state == plain_registrations
    assert bound is True
    assert finders == 0


def test_a_seeded_generator_draws_as_after_a_plain_import() -> None:
    """Sampling with a seed makes a torch.Generator, which torch 2.13 refuses to make before
    torch._prims.rng_prims has bound its metaclass: the deferred import brings that module alone."""
    draw = "g = torch.Generator(); g.manual_seed(7); print(json.dumps(torch.rand(4, generator=g).tolist()))\n"
    importing = "import json\nfrom worker.torch_import import import_torch\nassert import_torch()\nimport torch\n"
    deferred = _run(importing + draw)
    assert deferred == _run("import json, torch\n" + draw)


def test_a_torch_not_verified_is_imported_whole() -> None:
    code = (
        "import json, sys\n"
        "import worker.torch_import as ti\n"
        "ti.VERIFIED = ('0.0.',)\n"
        "deferred = ti.import_torch()\n"
        f"print(json.dumps([deferred, {DEFERRED!r} in sys.modules, 'torch' in sys.modules]))\n"
    )
    assert _run(code) == [False, True, True]
