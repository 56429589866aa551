"""Where Triton's key of its own files is kept (worker/triton_key.py): a name that changes with any file
of the installation but not with the byte-code Python writes beside it. Triton itself is on GPU hosts
only; tests/gpu/test_cuda_startup.py keeps and reads back its real key."""

from __future__ import annotations

import os
from pathlib import Path

from worker.triton_key import KEPT_PREFIX, kept_path


def _install(root: Path) -> Path:
    (root / "_C").mkdir(parents=True)
    (root / "_C" / "libtriton.so").write_bytes(b"\x7fELF" + bytes(4096))
    (root / "runtime").mkdir()
    (root / "runtime" / "cache.py").write_text("def triton_key():\n    return 'x'\n")
    return root


def test_the_name_stands_for_every_file_of_the_installation(tmp_path: Path) -> None:
    root = _install(tmp_path / "triton")
    kept = tmp_path / "cache"
    first = kept_path(kept, "3.6.0", root)
    assert first is not None and first.parent == kept and first.name.startswith(KEPT_PREFIX)
    assert kept_path(kept, "3.6.0", root) == first
    assert kept_path(kept, "3.6.1", root) != first

    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"byte-code")
    assert kept_path(kept, "3.6.0", root) == first  # what Python writes as it imports is not Triton's

    lib = root / "_C" / "libtriton.so"
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    touched = kept_path(kept, "3.6.0", root)
    assert touched not in (None, first)

    (root / "runtime" / "cache.py").write_text("def triton_key():\n    return 'yz'\n")  # an edit
    edited = kept_path(kept, "3.6.0", root)
    assert edited not in (None, first, touched)

    (root / "language").mkdir()
    (root / "language" / "core.py").write_text("")
    assert kept_path(kept, "3.6.0", root) not in (None, first, touched, edited)


def test_no_directory_or_an_unreadable_installation_keeps_nothing(tmp_path: Path) -> None:
    root = _install(tmp_path / "triton")
    assert kept_path(None, "3.6.0", root) is None
    assert kept_path(tmp_path / "cache", "3.6.0", tmp_path / "missing") is None


def test_linked_folders_are_followed_once(tmp_path: Path) -> None:
    """A development install links its backends in; Triton's own key reads the files behind them."""
    root = _install(tmp_path / "triton")
    outside = tmp_path / "third_party" / "nvidia"
    outside.mkdir(parents=True)
    (outside / "compiler.py").write_text("x = 1\n")
    (root / "backends").mkdir()
    (root / "backends" / "nvidia").symlink_to(outside, target_is_directory=True)
    (root / "backends" / "loop").symlink_to(root, target_is_directory=True)  # walked once, not forever
    kept = tmp_path / "cache"
    first = kept_path(kept, "3.6.0", root)
    (outside / "compiler.py").write_text("x = 22\n")
    assert kept_path(kept, "3.6.0", root) not in (None, first)
