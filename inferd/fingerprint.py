"""Which K/V a worker may reuse: the fingerprint of everything that determines it.

A worker attaches to memd under its model's fingerprint; memd shares blocks
and resumes sequences only between workers of one fingerprint (a session
parked under another is recomputed, keeping its history). So the fingerprint
must change whenever K/V would: every byte of every weight file, the config
(shapes, RoPE), the dtype, the tokenizer, the block size and the page layout.
A checkpoint fine-tuned in place, even one tensor deep inside a file of the
same size, gets a new fingerprint.

Hashing 16 GB of weights takes seconds, so each file's digest is cached,
keyed by its size, modification time and inode: a restart rehashes nothing,
a rewritten file is hashed again. The cache lives beside the checkpoint when
that directory is writable, else under $XDG_CACHE_HOME/kvpool.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog

from inferd.checkpoint import ModelConfig

log = structlog.get_logger("inferd")

CACHE_NAME = ".kvpool-fingerprint.json"
VERSION = 1


def model_fingerprint(model_dir: Path, config: ModelConfig, block_size: int) -> str:
    """`{directory name}-{12 hex digits}`: readable in memctl, unique to what determines K/V."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"kvpool-fingerprint-{VERSION}\0".encode())
    h.update((model_dir / "config.json").read_bytes())
    h.update(f"\0{config.dtype_name}\0{block_size}\0{config.page_shape(block_size)}\0".encode())
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.exists():
        h.update(hashlib.blake2b(tokenizer.read_bytes(), digest_size=16).digest())
    for name, digest in weight_digests(model_dir).items():
        h.update(f"{name}\0".encode() + bytes.fromhex(digest))
    return f"{model_dir.name}-{h.hexdigest()[:12]}"


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
