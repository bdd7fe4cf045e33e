"""Each weight file's content digest, cached: what a K/V namespace needs to know about the weights, cheaply.

Hashing 16 GB of weights takes seconds, so each file's digest is cached,
keyed by its size, modification time and inode: a restart rehashes nothing,
a rewritten file is hashed again. The cache lives beside the checkpoint when
that directory is writable, else under $XDG_CACHE_HOME/kvpool. inferd's
fingerprint and the vLLM connector's namespace both cover these digests, so a
checkpoint fine-tuned in place, even one tensor deep inside a file of the
same size, gets a new namespace.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog

log = structlog.get_logger("kvpool")

CACHE_NAME = ".kvpool-fingerprint.json"
VERSION = 1


def weight_digests(model_dir: Path) -> dict[str, str]:
    """Each *.safetensors file's content digest, from the cache where the file is unchanged."""
    cache_path = _cache_path(model_dir)
    cached = _read_cache(cache_path)
    digests, fresh = {}, False
    for file in sorted(model_dir.glob("*.safetensors")):
        st = file.stat()
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = cached.get(file.name)
        if entry is not None and entry.get("key") == key:
            digests[file.name] = entry["digest"]
            continue
        with file.open("rb") as f:
            digests[file.name] = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
        cached[file.name] = {"key": key, "digest": digests[file.name]}
        fresh = True
    if fresh:
        _write_cache(cache_path, {name: cached[name] for name in digests})
    return digests


def _cache_path(model_dir: Path) -> Path:
    if os.access(model_dir, os.W_OK):
        return model_dir / CACHE_NAME
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=8).hexdigest()
    return home / "kvpool" / f"fingerprint-{tag}.json"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if isinstance(data, dict) and data.get("version") == VERSION else {}


def _write_cache(path: Path, files: dict[str, dict]) -> None:
    """Best effort: a cache that cannot be written only costs the next start a rehash."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}")
        tmp.write_text(json.dumps({"version": VERSION, "files": files}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache the weights' fingerprint; the next start hashes them again", path=str(path),
                    error=exc.strerror)
