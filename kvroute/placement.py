"""Where a request without a known session goes: prefix locality within a load bound, else the least loaded.

The prefix key is the request's leading text (its first messages, role-tagged,
or its prompt), about a KV block or two of tokens: requests that share a system
prompt or continue the same conversation share it. Rendezvous hashing maps a key
to a worker the same way on every kvroute, without shared state, and moves only
the keys of a worker that leaves; that worker's prefix cache then holds the
prompt's leading blocks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PREFIX_CHARS = 128          # about two 16-token blocks of text


class Candidate(Protocol):
    url: str

    @property
    def load(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Placement:
    worker: Any
    reason: str             # "prefix" or "load" (the caller adds "affinity" and "failover")


def prefix_key(body: Any) -> bytes | None:
    """The leading text of a chat or completion request; None when it has none (routed by load alone)."""
    if not isinstance(body, dict):
        return None
    text = ""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict) or len(text) >= PREFIX_CHARS:
                break
            text += f"{message.get('role')}\x00{_content_text(message.get('content'))}\x00"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text = " ".join(map(str, prompt[:32]))              # token ids: the first two blocks' worth
    return text[:PREFIX_CHARS].encode() if text else None


def _content_text(content: Any) -> str:
    if isinstance(content, list):                               # OpenAI content parts
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(text for text in texts if isinstance(text, str))
    return content if isinstance(content, str) else ""


def rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest()


def place(key: bytes | None, workers: Sequence[Candidate], slack: int) -> Placement:
    """The worker `key` hashes to if its load is within `slack` requests of the least loaded's, else that one.

    `workers` are the healthy ones (at least one). Ties for least loaded are
    broken at random, so idle workers share requests that carry no key.
    """
    least = min(w.load for w in workers)
    if key is not None:
        preferred = max(workers, key=lambda w: rendezvous(key, w.url))
        if preferred.load <= least + slack:
            return Placement(preferred, "prefix")
    return Placement(random.choice([w for w in workers if w.load == least]), "load")
