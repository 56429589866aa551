"""Models by Hugging Face Hub id: ``--model Qwen/Qwen2.5-0.5B-Instruct`` (or ``...@<revision>``) is a
local snapshot that ``huggingface_hub`` keeps, with its cache (``HF_HOME``, ``HF_HUB_CACHE``), its
token (``HF_TOKEN``, or ``hf auth login``), its offline mode (``HF_HUB_OFFLINE=1``: the cache alone)
and its download progress bars.

Why: users name models as the Hub does, and ``--model Qwen/...`` used to fail with "config.json does
not exist". A spec that is a directory here is that directory, whatever else it could mean; a spec
that could only be a path (it starts with ``/``, ``.`` or ``~``, or has more than one ``/``) is not
looked up on the Hub, so a typo in a path is not sent to the network. Only the files memsvc reads are
fetched: the config, the safetensors shards and their index, the tokenizer and the chat template.
"""

from __future__ import annotations

import re
from pathlib import Path

from memsvc.errors import InvalidArgument, NotFound
from worker.checkpoint_files import SYNTHETIC_PREFIX

FILES = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
"""What a snapshot download fetches (``allow_patterns``): what the loader and ModelText read. The
weights as transformers names them (``model.safetensors``, ``model-00001-of-00004.safetensors``), at
the top: a repository that also ships ``consolidated.safetensors`` or copies in a subfolder would
otherwise be downloaded twice."""

_HUB_ID = re.compile(r"^(?![.~])[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")
"""``name``, ``org/name``, either with ``@revision`` (a branch, a tag or a commit)."""


def is_hub_id(spec: str) -> bool:
    """``spec`` could name a Hub repository (and not only a path)."""
    return bool(_HUB_ID.match(spec)) and ".." not in spec


def may_be_local(spec: str) -> bool:
    """Whether ``spec`` may name a checkpoint on this host: a directory, or a Hub id (whose snapshot
    the Hub cache may hold: :func:`cached_dir` looks)."""
    return Path(spec).expanduser().is_dir() or is_hub_id(spec)


def known_dir(spec: str) -> Path | None:
    """The directory :func:`resolve` returns for ``spec`` without asking the Hub: ``spec`` itself, where
    it is a directory here (and not a synthetic model's name); else None."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return None
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def cached_dir(spec: str) -> Path | None:
    """The directory ``spec`` names here, asking no network: itself, or the snapshot of its Hub id that
    the Hub cache holds (the revision as the cache's refs name it); None if neither.

    For the start-up's read-ahead and staging (worker/prefetch.py, worker/staging.py), which run
    before the load resolves ``spec``: where :func:`resolve` then finds a newer snapshot on the Hub,
    the load reads that one and what was read ahead or staged of the old one goes unused (a staged
    shard is matched to the file the load opens, worker/staging.py's ``file_id``)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not is_hub_id(spec):
        return None
    repo, _, revision = spec.partition("@")
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=revision or None)
    except Exception:  # noqa: BLE001 - no huggingface_hub, an id it refuses: nothing to read ahead (the load says why)
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve(spec: str) -> Path:
    """The directory ``spec`` names: itself when it exists here, else the Hub snapshot of the
    repository it names (downloaded into the cache unless offline). A spec that is neither: the
    path (the checkpoint reader then says what is missing there)."""
    path = Path(spec).expanduser()
    if path.exists() or not is_hub_id(spec):
        return path
    repo, _, revision = spec.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise InvalidArgument(
            f"{spec!r} is not a directory here; as a Hugging Face Hub id it needs huggingface_hub "
            "(pip install 'memsvc[worker]')"
        ) from None
    tried = f"{spec!r} is not a directory here, and as a Hugging Face Hub id"
    try:
        return Path(snapshot_download(repo_id=repo, revision=revision or None, allow_patterns=FILES))
    except LocalEntryNotFoundError:
        raise NotFound(
            f"{tried} it is not in the Hub cache, and the Hub could not be asked (offline: HF_HUB_OFFLINE, or no "
            "network); download it first, or point --model at a checkpoint directory",
            metadata={"model": spec},
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise NotFound(f"{tried}: {type(exc).__name__}: {exc}", metadata={"model": spec}) from None
    except Exception as exc:  # the Hub's HTTP errors, a full disk: say what was tried
        raise InvalidArgument(f"{tried}: {type(exc).__name__}: {exc}", metadata={"model": spec}) from None


__all__ = ["FILES", "cached_dir", "is_hub_id", "known_dir", "may_be_local", "resolve"]
