"""The kernels a start compiled, kept for the next start of the model (worker/model/kept_kernels.py):
the file's name, what a file that is not ours yields, what is preloaded and skipped, and what is
written when. Triton itself is on GPU hosts only: here its JIT functions are stand-ins that take a
specialisation as ``JITFunction.preload`` does; tests/gpu/test_cuda_startup.py runs the real ones in
two fresh processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.model import kept_kernels
from worker.model.kept_kernels import KEPT_PREFIX, MAX_KEPT, kernels_path, read_specs


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test is a process of its own: nothing recorded or kept before it."""
    monkeypatch.setattr(kept_kernels, "_state", kept_kernels._Kept())
    yield


class Jitted:
    """A JIT function's stand-in: ``preload`` gives a compiled kernel whose ``_init_handles`` loads it,
    and, as Triton does, calls the post-compile hook of ``hooks`` (where given) for it."""

    def __init__(self, name: str, fails: bool = False, hooks: SimpleNamespace | None = None) -> None:
        self.name, self.fails, self.hooks = name, fails, hooks
        self.loaded: list[str] = []

    def preload(self, spec: str) -> Any:
        if self.fails:
            raise RuntimeError("out of resources: shared memory")
        if self.hooks is not None:
            compiled(self.hooks, self, spec, preloading=True)
        return SimpleNamespace(_init_handles=lambda: self.loaded.append(spec))


def spec(name: str, key: str) -> str:
    """A specialisation as Triton serialises one (the fields preload reads)."""
    return json.dumps({"name": name, "signature": {}, "key": key, "options": {}})


def compiled(hooks: SimpleNamespace, kernel: Any, data: str, preloading: bool = False) -> Any:
    """What Triton does after compiling ``kernel``: call the hook with its specialisation."""
    return hooks.jit_post_compile_hook(
        key=data,
        repr="",
        fn=SimpleNamespace(jit_function=kernel),
        compile={"specialization_data": data},
        is_manual_warmup=preloading,
        already_compiled=False,
    )


def test_the_name_changes_with_triton_the_device_the_kernels_and_the_model(tmp_path: Path) -> None:
    first = kernels_path(tmp_path, "3.6.0", (9, 0), ["a", "b"], b'{"hidden_size": 4096}')
    assert first.parent == tmp_path and first.name.startswith(KEPT_PREFIX) and first.suffix == ".json"
    assert kernels_path(tmp_path, "3.6.0", (9, 0), ["b", "a"], b'{"hidden_size": 4096}') == first
    others = {
        kernels_path(tmp_path, "3.6.1", (9, 0), ["a", "b"], b'{"hidden_size": 4096}'),
        kernels_path(tmp_path, "3.6.0", (10, 0), ["a", "b"], b'{"hidden_size": 4096}'),
        kernels_path(tmp_path, "3.6.0", (9, 0), ["a", "c"], b'{"hidden_size": 4096}'),
        kernels_path(tmp_path, "3.6.0", (9, 0), ["a", "b"], b'{"hidden_size": 2048}'),
    }
    assert len(others) == 4 and first not in others


@pytest.mark.parametrize(
    "content",
    [None, b"\xff\xfe", b"not json", b'{"name": "x"}', b'["a", 1]', b"[[]]"],
    ids=["missing", "not text", "not json", "not a list", "not all strings", "a list in the list"],
)
def test_a_file_that_is_not_a_list_of_specialisations_keeps_none(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "kept.json"
    if content is not None:
        path.write_bytes(content)
    assert read_specs(path) == []
    hooks = SimpleNamespace(jit_post_compile_hook=None)
    assert kept_kernels.preload({"k": Jitted("k")}, path, hooks) == 0


def test_each_kept_kernel_of_ours_is_loaded_and_the_rest_skipped(tmp_path: Path) -> None:
    """Kept for a kernel we no longer have, unreadable, or refused by Triton: skipped, and the others
    loaded all the same (their launches would compile the skipped ones as before)."""
    ours, refusing = Jitted("ours"), Jitted("refusing", fails=True)
    specs = [spec("ours", "k1"), spec("gone", "k2"), "{", spec("refusing", "k3"), spec("ours", "k4")]
    path = tmp_path / "kept.json"
    path.write_text(json.dumps(specs))
    hooks = SimpleNamespace(jit_post_compile_hook=None)
    assert kept_kernels.preload({"ours": ours, "refusing": refusing}, path, hooks) == 2
    assert ours.loaded == [spec("ours", "k1"), spec("ours", "k4")]


def test_what_a_start_compiles_is_kept_and_a_start_that_compiles_nothing_new_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, other = Jitted("ours"), Jitted("someone else's")
    path = tmp_path / "kept.json"
    answers: list[str] = []

    def earlier_hook(**kwargs: Any) -> str:
        answers.append(kwargs["key"])
        return "theirs"

    hooks = SimpleNamespace(jit_post_compile_hook=earlier_hook)
    assert kept_kernels.preload({"ours": ours}, path, hooks) == 0  # the first start: nothing kept yet
    assert kept_kernels.keep() == 0  # nothing compiled yet
    assert not path.exists()
    # the warm-up's launches compile two of ours and one of another library's
    assert compiled(hooks, ours, spec("ours", "a")) == "theirs"  # the hook set before still answers
    compiled(hooks, ours, spec("ours", "b"))
    compiled(hooks, other, spec("someone else's", "c"))
    assert answers == [spec("ours", "a"), spec("ours", "b"), spec("someone else's", "c")]
    assert kept_kernels.compiled_after() == 2
    assert kept_kernels.keep() == 2
    assert read_specs(path) == sorted([spec("ours", "a"), spec("ours", "b")])
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]  # written whole: no temporary left

    # the next start: both loaded ahead (Triton calls the hook for each preload too), nothing compiled
    monkeypatch.setattr(kept_kernels, "_state", kept_kernels._Kept())
    hooks = SimpleNamespace(jit_post_compile_hook=None)
    again = Jitted("ours", hooks=hooks)
    written = path.stat().st_mtime_ns
    assert kept_kernels.preload({"ours": again}, path, hooks) == 2
    assert kept_kernels.compiled_after() == 0
    assert kept_kernels.keep() == 0 and path.stat().st_mtime_ns == written

    # a start whose launches need one more: the file gets it, beside the two
    compiled(hooks, again, spec("ours", "d"))
    assert kept_kernels.compiled_after() == 1
    assert kept_kernels.keep() == 3
    assert read_specs(path) == sorted([spec("ours", k) for k in "abd"])


def test_past_the_bound_a_file_keeps_the_last_starts_alone(tmp_path: Path) -> None:
    path = tmp_path / "kept.json"
    earlier = [spec("ours", f"old{i}") for i in range(MAX_KEPT)]
    path.write_text(json.dumps(earlier))
    hooks = SimpleNamespace(jit_post_compile_hook=None)
    ours = Jitted("ours")
    assert kept_kernels.preload({"ours": ours}, path, hooks) == MAX_KEPT
    compiled(hooks, ours, spec("ours", "new"))
    assert kept_kernels.keep() == 1
    assert read_specs(path) == [spec("ours", "new")]


def test_a_file_that_cannot_be_written_is_not_kept_and_raises_nothing(tmp_path: Path) -> None:
    path = tmp_path / "gone" / "kept.json"  # its folder removed since (a cache cleared)
    hooks = SimpleNamespace(jit_post_compile_hook=None)
    ours = Jitted("ours")
    kept_kernels.preload({"ours": ours}, path, hooks)
    compiled(hooks, ours, spec("ours", "a"))
    assert kept_kernels.keep() == 0
    assert not path.parent.exists()


def test_nothing_is_kept_where_nothing_was_preloaded() -> None:
    """A load that did not go through the import thread's preload (a standby's) has no file to keep in."""
    assert kept_kernels.keep() == 0
