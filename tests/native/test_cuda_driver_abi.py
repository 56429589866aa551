"""native/cuda_driver.h against the toolkit's cuda.h: the same layouts and the same numbers.

The extension declares the slice of the driver API it uses itself, so it builds where no toolkit is
installed; a wrong struct layout or constant there would only show on a GPU, as a driver error or
worse. Where cuda.h is present, two tiny C programs print the size of every type, the size and every
member offset of every struct, and the value of every #define and enumerator that cuda_driver.h
declares, one against cuda.h and one against cuda_driver.h; their outputs must be equal. (The entry
points' signatures are not compared: each is asked of the driver at an explicit API version.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from childproc import REPO_ROOT

HEADER = REPO_ROOT / "native" / "cuda_driver.h"
CUDA_INCLUDE = next(
    (
        d
        for d in (Path(os.environ.get("CUDA_HOME", "/nonexistent")) / "include", Path("/usr/local/cuda/include"))
        if (d / "cuda.h").is_file()
    ),
    None,
)
CC = shutil.which("gcc") or shutil.which("cc")

pytestmark = [
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="no cuda.h (CUDA toolkit headers) here"),
    pytest.mark.skipif(CC is None, reason="no C compiler"),
]


def _struct_members(body: str, prefix: str = "") -> list[str]:
    """Member designators of a struct body, nested anonymous structs as ``outer.inner``."""
    members: list[str] = []
    while body.strip():
        body = body.strip()
        if body.startswith("struct"):
            close = _matching_brace(body, body.index("{"))
            name = re.match(r"\s*(\w+)\s*;", body[close + 1 :])
            assert name, f"cannot read the nested struct in {body[:60]!r}"
            members.append(prefix + name.group(1))
            members += _struct_members(body[body.index("{") + 1 : close], prefix + name.group(1) + ".")
            body = body[close + 1 + name.end() :]
            continue
        decl, _, body = body.partition(";")
        name = re.search(r"(\w+)\s*(\[\s*\d+\s*\])?\s*$", decl)
        assert name, f"cannot read the member {decl!r}"
        members.append(prefix + name.group(1))
    return members


def _matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise AssertionError("unbalanced braces in cuda_driver.h")


def _declarations(text: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(scalar and enum type names, struct name -> members, #define and enumerator names) of the header."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    constants = re.findall(r"^#define\s+(CU\w+)\s+\S", text, flags=re.M)
    types = re.findall(r"^typedef\s+[\w\s]+?\**\s*\b(CU\w+|cuuint64_t)\s*;", text, flags=re.M)
    structs: dict[str, list[str]] = {}
    for m in re.finditer(r"^typedef\s+(struct|enum)\s*\{", text, flags=re.M):
        close = _matching_brace(text, m.end() - 1)
        name = re.match(r"\s*(\w+)\s*;", text[close + 1 :])
        assert name, "a typedef of an anonymous struct or enum without a name"
        body = text[m.end() : close]
        if m.group(1) == "enum":
            types.append(name.group(1))
            constants += re.findall(r"\b(CU\w+)\s*=", body)
        else:
            structs[name.group(1)] = _struct_members(body)
    return types, structs, constants


def _program(include: str, types: list[str], structs: dict[str, list[str]], constants: list[str]) -> str:
    def row(what: str, name: str, expr: str, fmt: str = "%zu") -> str:
        return f'  printf("{what} {name} {fmt}\\n", {expr});'

    rows = [row("sizeof", t, f"sizeof({t})") for t in types]
    for s, members in structs.items():
        rows.append(row("sizeof", s, f"sizeof({s})"))
        rows += [row("offsetof", f"{s}.{m}", f"offsetof({s}, {m})") for m in members]
    rows += [row("value", c, f"(long long)({c})", "%lld") for c in constants]
    head = f"#include <stddef.h>\n#include <stdio.h>\n#include {include}\n\n"
    return head + "int main(void) {\n" + "\n".join(rows) + "\n  return 0;\n}\n"


def _run(tmp_path: Path, name: str, source: str, include_dir: Path) -> str:
    src, exe = tmp_path / f"{name}.c", tmp_path / name
    src.write_text(source)
    assert CC is not None
    subprocess.run([CC, "-std=gnu11", f"-I{include_dir}", str(src), "-o", str(exe)], check=True, capture_output=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_cuda_driver_h_matches_cuda_h(tmp_path: Path) -> None:
    types, structs, constants = _declarations(HEADER.read_text())
    assert len(types) >= 10 and len(structs) >= 4 and len(constants) >= 15, (types, structs, constants)
    assert CUDA_INCLUDE is not None
    ours = _run(tmp_path, "ours", _program('"cuda_driver.h"', types, structs, constants), HEADER.parent)
    theirs = _run(tmp_path, "theirs", _program("<cuda.h>", types, structs, constants), CUDA_INCLUDE)
    assert ours.splitlines() == theirs.splitlines()
