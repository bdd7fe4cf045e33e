"""Which K/V a worker may reuse: the fingerprint of everything that determines it.

A worker attaches to memd under its model's fingerprint; memd shares blocks
and resumes sequences only between workers of one fingerprint (a session
parked under another is recomputed, keeping its history). So the fingerprint
must change whenever K/V would: every byte of every weight file, the config
(shapes, RoPE), the dtype, the tokenizer, the block size and the page layout.
A checkpoint fine-tuned in place, even one tensor deep inside a file of the
same size, gets a new fingerprint.

Each weight file's digest is cached (shared.weight_digests): a restart
rehashes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from inferd.checkpoint import ModelConfig
from shared.weight_digests import CACHE_NAME, VERSION, weight_digests

__all__ = ["CACHE_NAME", "model_fingerprint"]


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
