"""worker/torch_libraries.py: torch's shared libraries loaded ahead of its import, without the GIL.

Each case runs in an interpreter of its own: what a process has loaded stays loaded, and this one
has imported torch already."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from childproc import REPO_ROOT

CHILD_TIMEOUT_S = 300.0
"""Bounds a child that hangs (a dlopen that held the GIL would, in the second case); not a wait."""

BLOCKER = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

/* Loading this blocks until a byte arrives on the FIFO its environment names: whoever loads it
   cannot return before another thread of the process has written there. */
__attribute__((constructor)) static void wait_for_a_byte(void) {
    const char *path = getenv("MEMSVC_TEST_FIFO");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY);
    char byte;
    if (fd >= 0) { (void)!read(fd, &byte, 1); close(fd); }
}
"""


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return done


def test_torchs_libraries_load_ahead_and_the_import_then_finds_them_and_computes() -> None:
    code = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO)
from worker import torch_libraries

def mapped():
    return {f[5] for f in (line.split() for line in open("/proc/self/maps")) if len(f) >= 6 and ".so" in f[5]}

wanted = torch_libraries.libraries()
torch_libraries.start()
torch_libraries.wait()
before, imported = mapped(), "torch" in sys.modules
import torch
names = [os.path.basename(p) for p in mapped()]
x = torch.arange(4.0)
print(json.dumps({
    "wanted": [[os.path.realpath(p), mode] for p, mode in wanted],
    "before": sorted(os.path.realpath(p) for p in before),
    "imported_before": imported,
    "twice": sorted({n for n in names if names.count(n) > 1}),
    "dot": float(x @ x),
}))
"""
    done = _child(code)
    out = json.loads(done.stdout)
    (deps, deps_mode), (libtorch, libtorch_mode) = out["wanted"]
    assert Path(deps).name == "libtorch_global_deps.so" and deps_mode == os.RTLD_NOW | os.RTLD_GLOBAL
    assert Path(libtorch).name == "libtorch.so" and libtorch_mode == os.RTLD_NOW | os.RTLD_LOCAL
    # loaded before torch was imported, with what libtorch needs (its CPU half at least)
    assert not out["imported_before"] and {deps, libtorch} <= set(out["before"])
    assert str(Path(libtorch).with_name("libtorch_cpu.so")) in out["before"]
    # the import used them: no library of the process is there twice, and torch computes
    assert out["twice"] == [] and out["dot"] == 14.0
    assert "torch's shared libraries loaded ahead in" in done.stderr


def test_the_libraries_load_without_the_gil(tmp_path: Path) -> None:
    """A library whose initialiser blocks until another thread writes to a FIFO: the main thread
    writes it while the loading thread is inside dlopen, which it could not do if dlopen held the GIL."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc) builds the blocking library, as it builds the native extension"
    source, lib, fifo = tmp_path / "blocker.c", tmp_path / "libblocker.so", tmp_path / "fifo"
    source.write_text(BLOCKER)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(source)], check=True)
    os.mkfifo(fifo)
    code = f"""
import os
from worker import torch_libraries
torch_libraries.libraries = lambda: (({str(lib)!r}, os.RTLD_NOW),)
torch_libraries.start()
with open({str(fifo)!r}, "wb") as f:  # the loader's initialiser has it open for reading: this returns
    f.write(b"x")
torch_libraries.wait()
print("loaded" if {str(lib)!r} in open("/proc/self/maps").read() else "not loaded")
"""
    done = _child(code, {"MEMSVC_TEST_FIFO": str(fifo)})
    assert done.stdout.split() == ["loaded"]


def test_a_library_that_fails_to_load_ends_the_preload_and_the_import_goes_on(tmp_path: Path) -> None:
    missing = tmp_path / "libnothing.so"
    code = f"""
import logging, os
logging.basicConfig(level=logging.DEBUG)
from worker import torch_libraries
torch_libraries.libraries = lambda: (({str(missing)!r}, os.RTLD_NOW),)
torch_libraries.start()
torch_libraries.wait()
import torch
print(int(torch.ones(3).sum()))
"""
    done = _child(code)
    assert done.stdout.split() == ["3"]
    assert f"loading {missing} ahead failed" in done.stderr and "loaded ahead in" not in done.stderr


@pytest.mark.parametrize("case", ["imported", "rtld_global", "nvidia_elsewhere", "no_torch"])
def test_nothing_is_named_where_the_import_could_load_other_files(case: str, tmp_path: Path) -> None:
    """Torch imported already; its libraries asked into the global scope; an earlier sys.path entry
    with the CUDA libraries' pip folder (torch would load those, its RPATH the others); no torch."""
    setup = {
        "imported": "import torch",
        "rtld_global": "os.environ['TORCH_USE_RTLD_GLOBAL'] = '1'",
        "nvidia_elsewhere": f"os.makedirs({str(tmp_path / 'nvidia')!r}); sys.path.insert(0, {str(tmp_path)!r})",
        "no_torch": "import importlib.util; importlib.util.find_spec = lambda name, package=None: None",
    }[case]
    code = f"""
import os, sys
{setup}
from worker import torch_libraries
print(len(torch_libraries.libraries()))
"""
    assert _child(code).stdout.split() == ["0"]  # the first case here shows the two it names otherwise


def test_nothing_is_named_where_ld_library_path_has_a_cuda_wheels_library(tmp_path: Path) -> None:
    """A site with torch's two libraries and a CUDA wheel's: named, unless a folder of
    LD_LIBRARY_PATH holds a library of that wheel's name (a RUNPATH would find that one)."""
    site, shadow, other = tmp_path / "site", tmp_path / "shadow", tmp_path / "other"
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    for name in ("libtorch_global_deps.so", "libtorch.so"):
        (site / "torch" / "lib" / name).write_bytes(b"")
    (site / "nvidia" / "cublas" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cublas" / "lib" / "libcublas.so.13").write_bytes(b"")
    for folder, name in ((shadow, "libcublas.so.13"), (other, "libsomething.so.1")):
        folder.mkdir()
        (folder / name).write_bytes(b"")
    code = f"""
import sys
sys.path.insert(0, {str(site)!r})
from worker import torch_libraries
print(" ".join(p.split("/")[-1] for p, _ in torch_libraries.libraries()) or "none")
"""
    for path, named in ((f"{other}", "libtorch_global_deps.so libtorch.so"), (f"{other}:{shadow}", "none")):
        assert _child(code, {"LD_LIBRARY_PATH": path}).stdout.strip() == named
