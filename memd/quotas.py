"""Page quotas per tenant and per model: what others' pressure may take from a holder, and what it may hold.

A holder is a tenant (the name a worker opens a sequence under, Open.tenant)
or a model; every sequence belongs to one of each. A holder may have

- `guaranteed` pages: eviction for anyone's pressure never takes its parked
  sequences below it (a sequence whose eviction would is passed over), and
- `max` pages: a Step that would take it past is refused (RESOURCE_EXHAUSTED,
  reason "quota") once evicting its own coldest parked sequences cannot make
  room within it; its worker holds that holder's requests back, and no other
  holder loses a page for it. Under pressure, holders past their max (after
  an operator lowered it) are evicted first, then heat decides as before.

A holder's usage is the pool pages its sequences hold: a page two of its
sequences share counts once, and a page two tenants' sequences share
(`shared_prefix` tenants' common system prompt) counts for each of them.
Usage is kept as sequences take and let go of pages (memd.holder_ledger),
so it is exact at every instant and costs a Step only the pages it changed;
after a restart it is counted again from the sequences memd's journal
restores, and `memctl check` compares it with a count from the sequences.

Quotas come from `memd --quotas FILE` (TOML; the tenants file inferd reads
with --api-keys serves, the fields below being memd's and the keys inferd's):

    [tenants.acme]
    guaranteed_pages = 512
    max_pages = 2048

    [models.tiny]
    max_pages = 4096

and change at run time with `memctl quota` (the SetQuota call, admin only).
Those changes are kept in memd's state directory (quotas.json, written whole
and renamed into place) and outlive a restart, over what the file says.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from memd.errors import InvalidArgument, KvError
from memd.sequences import Sequence
from shared.toml_file import read_toml

Kind = Literal["tenant", "model"]
Key = tuple[Kind, str]
KINDS: tuple[Kind, ...] = ("tenant", "model")
SECTIONS: dict[str, Kind] = {"tenants": "tenant", "models": "model"}
FIELDS = ("guaranteed_pages", "max_pages")
NAME = re.compile(r"[^\0]{1,256}")
SAVED = "quotas.json"


class QuotaError(ValueError):
    """A quotas file memd cannot use: one line says why, and memd does not start."""


class QuotaExceeded(KvError):
    """A Step would take a holder past its max pages, and evicting its own parked sequences cannot help."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, key: Key, usage: int, limit: int, index: int) -> None:
        kind, name = key
        super().__init__(f"{kind} {name!r} would hold {usage} pages, past its max of {limit}: its requests wait "
                         "until its own sequences give pages back")
        self.key, self.usage, self.limit, self.index = key, usage, limit, index
        self.reason = "quota" if kind == "tenant" else "model_quota"      # a model's: every tenant of it waits


class TooBigForQuota(InvalidArgument):
    """One sequence bigger than its tenant's or model's max: it could never run, so it is not left to wait."""

    reason = "quota_size"


@dataclass(frozen=True, slots=True)
class Quota:
    guaranteed: int = 0           # pages others' pressure never takes from it
    max: int = 0                  # 0: no max

    def as_list(self) -> list[int]:
        return [self.guaranteed, self.max]


class Pages(Protocol):
    """Holders' pages as an eviction walk sees them (memd.holder_ledger.Going)."""

    def usage(self, key: Key) -> int: ...

    def gain(self, key: Key, seq: Sequence) -> int: ...


@dataclass(frozen=True, slots=True)
class Holding:
    """One tenant's or model's quota and what it holds now (memctl quota, memctl tenants, the metrics)."""

    key: Key
    quota: Quota
    pages: int
    evictions: int
    refusals: int
    set_at_run_time: bool
    sequences: dict[str, int]
    retained_pages: int = 0
    sessions: int = 0
    swap_slots: int = 0


class HolderUsage(Protocol):
    @property
    def usage(self) -> Counter[Key]: ...


class HolderCounts(Protocol):
    """What memd.seq_index keeps per holder: sequences by state, pages (its ledger), promised pages, sessions,
    swap slots."""

    @property
    def holder_states(self) -> Mapping[Key, Counter[str]]: ...
    @property
    def ledger(self) -> HolderUsage: ...
    @property
    def retained(self) -> Mapping[Key, int]: ...
    @property
    def holder_sessions(self) -> Mapping[Key, int]: ...
    @property
    def holder_slots(self) -> Mapping[Key, int]: ...


def describe(key: Key) -> str:
    return f"{key[0]} {key[1]!r}"


class Owned(Protocol):
    """Whose a sequence is: a Sequence, or its row in a state copy (memd.state_copy.SeqCopy)."""

    tenant: str
    model: str


def keys_of(seq: Owned) -> tuple[Key, ...]:
    """The holders a sequence counts for: its tenant (if it has one) and its model."""
    return (("tenant", seq.tenant), ("model", seq.model)) if seq.tenant else (("model", seq.model),)


NO_TENANT: Key = ("tenant", "")    # the sequences of no tenant, counted as one for memctl tenants: never capped


def counted_for(seq: Owned) -> tuple[Key, ...]:
    """What memd counts a sequence's pages and states for: its holders, and NO_TENANT for one of no tenant."""
    return keys_of(seq) if seq.tenant else (NO_TENANT, ("model", seq.model))


@dataclass(slots=True)
class Quotas:
    """The quota table: the file's settings, those set at run time over them, and the holders' counters."""

    from_file: dict[Key, Quota] = field(default_factory=dict)
    set_at_run_time: dict[Key, Quota] = field(default_factory=dict)
    saved_to: Path | None = None              # the state directory's quotas.json, if memd keeps one
    table: dict[Key, Quota] = field(default_factory=dict)
    evictions: Counter[Key] = field(default_factory=Counter)    # per tenant and model, since memd started
    refusals: Counter[Key] = field(default_factory=Counter)     # Steps refused at a holder's max

    def __post_init__(self) -> None:
        self.table = self._merged()

    def _merged(self) -> dict[Key, Quota]:
        """The file's quotas with those set at run time over them; a quota of nothing is no quota."""
        return {k: q for k, q in {**self.from_file, **self.set_at_run_time}.items() if q != Quota()}

    @classmethod
    def load(cls, path: Path | None, state_dir: Path | None, num_blocks: int) -> Quotas:
        """The file's quotas (QuotaError if it cannot be used), then those set at run time and kept."""
        from_file = _read_file(path) if path is not None else {}
        saved_to = state_dir / SAVED if state_dir is not None else None
        kept = _read_saved(saved_to) if saved_to is not None else {}
        quotas = cls(from_file, kept, saved_to)
        try:
            quotas.check(num_blocks)
        except InvalidArgument as err:
            where = " and ".join(str(p) for p in (path, saved_to if kept else None) if p is not None)
            raise QuotaError(f"{where}: {err}" if where else str(err)) from None
        return quotas

    @property
    def capped(self) -> bool:
        """Some holder has a max: Steps are checked against it."""
        return any(q.max for q in self.table.values())

    def quota(self, key: Key) -> Quota:
        return self.table.get(key, Quota())

    def check(self, num_blocks: int) -> None:
        for key, quota in self.table.items():
            if quota.max and quota.guaranteed > quota.max:
                raise InvalidArgument(f"{describe(key)}: guaranteed pages ({quota.guaranteed}) past its max "
                                      f"({quota.max})")
            if max(quota.guaranteed, quota.max) > num_blocks:
                raise InvalidArgument(f"{describe(key)}: a quota of more pages than the pool's {num_blocks}")
        for kind in KINDS:
            promised = sum(q.guaranteed for (k, _), q in self.table.items() if k == kind)
            if promised > num_blocks:
                raise InvalidArgument(f"the {kind}s' guaranteed pages add up to {promised}, more than the pool's "
                                      f"{num_blocks}: memd could not keep every promise")

    def set(self, kind: str, name: str, quota: Quota | None, num_blocks: int) -> None:
        """Set (None: clear back to the file's) one holder's quota at run time; kept in the state directory."""
        if kind not in KINDS:
            raise InvalidArgument(f"a quota is a tenant's or a model's, not a {kind!r}'s")
        key: Key = (kind, name)   # type: ignore[assignment]   (one of KINDS, checked above)
        if not NAME.fullmatch(name):
            raise InvalidArgument(f"a {kind} name is 1 to 256 characters, none of them NUL")
        before = (dict(self.set_at_run_time), dict(self.table))
        if quota is None:
            self.set_at_run_time.pop(key, None)
        else:
            self.set_at_run_time[key] = quota
        self.table = self._merged()
        try:
            self.check(num_blocks)
            self._save()
        except (InvalidArgument, OSError) as err:
            self.set_at_run_time, self.table = before
            if isinstance(err, OSError):
                raise InvalidArgument(f"cannot keep the quota in {self.saved_to}: {err.strerror}") from None
            raise

    def _save(self) -> None:
        if self.saved_to is None:
            return
        document = {kind: {name: q.as_list() for (k, name), q in self.set_at_run_time.items() if k == kind}
                    for kind in KINDS}
        tmp = self.saved_to.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(document, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.saved_to)

    def protected(self, seq: Sequence, going: Pages) -> bool:
        """Evicting `seq` would take one of its holders below its guaranteed pages (`going`: the eviction walk's
        view of every holder's pages, memd.holder_ledger)."""
        for key in keys_of(seq):
            if (quota := self.table.get(key)) is not None and quota.guaranteed \
                    and going.usage(key) - going.gain(key, seq) < quota.guaranteed:
                return True
        return False

    def over(self, usage: Mapping[Key, int]) -> list[tuple[Key, int]]:
        """Holders past their max now, and by how many pages."""
        return [(key, usage.get(key, 0) - q.max) for key, q in self.table.items()
                if q.max and usage.get(key, 0) > q.max]

    def check_growth(self, usage: Mapping[Key, int], grown: dict[Key, int]) -> None:
        """`grown`: holders whose sequences took pages in a Step, each with the first op that did; `usage`: every
        holder's pages after it. QuotaExceeded for the first that is past its max now."""
        capped = {key: index for key, index in grown.items() if self.quota(key).max}
        for key, index in sorted(capped.items(), key=lambda item: item[1]):
            limit = self.table[key].max
            if usage.get(key, 0) > limit:
                raise QuotaExceeded(key, usage[key], limit, index)

    def holdings(self, counts: HolderCounts, *, no_tenant: bool = False) -> list[Holding]:
        """Every tenant and model with a quota, a sequence or a count: its quota, pages, sequences, sessions and
        swap slots (memd.seq_index keeps them); with `no_tenant`, NO_TENANT's row too if it holds any."""
        states = counts.holder_states
        present = {key for key, n in states.items() if any(n.values())}
        keys = present | set(self.table) | set(self.evictions) | set(self.refusals) \
            | {key for key, n in counts.retained.items() if n}
        if not no_tenant:
            keys.discard(NO_TENANT)
        return [Holding(key, self.quota(key), counts.ledger.usage.get(key, 0), self.evictions[key],
                        self.refusals[key], key in self.set_at_run_time,
                        {s: n for s, n in states.get(key, Counter()).items() if n}, counts.retained.get(key, 0),
                        counts.holder_sessions.get(key, 0), counts.holder_slots.get(key, 0))
                for key in sorted(keys)]

    def fits(self, seq: Sequence, blocks: int) -> None:
        """A sequence of `blocks` pages could never run under a max: refused as bad input, not left to wait."""
        for key in keys_of(seq):
            if (limit := self.quota(key).max) and blocks > limit:
                raise TooBigForQuota(f"a sequence of {blocks} pages does not fit {describe(key)}'s max of "
                                     f"{limit} pages")


def _quota(where: str, table: object) -> Quota:
    if not isinstance(table, dict):
        raise QuotaError(f"{where}: expected a table")
    values = []
    for name in FIELDS:
        value = table.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise QuotaError(f"{where}: {name} is a whole number of pages from 0, not {value!r}")
        values.append(value)
    return Quota(*values)


def _read_file(path: Path) -> dict[Key, Quota]:
    data = read_toml(path, QuotaError)
    found: dict[Key, Quota] = {}
    for section, kind in SECTIONS.items():
        tables = data.get(section, {})
        if not isinstance(tables, dict):
            raise QuotaError(f"{path}: [{section}.NAME] are tables")
        for name, table in tables.items():
            quota = _quota(f"{path}: {kind} {name!r}", table)
            if quota != Quota():
                found[(kind, name)] = quota
    return found


def _read_saved(path: Path) -> dict[Key, Quota]:
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise QuotaError(f"cannot read the quotas kept in {path}: {exc}; remove it to start from --quotas "
                         "alone") from None
    found: dict[Key, Quota] = {}
    try:
        for kind in KINDS:
            for name, (guaranteed, limit) in document.get(kind, {}).items():
                if not all(type(v) is int and v >= 0 for v in (guaranteed, limit)) or not isinstance(name, str):
                    raise ValueError(f"{kind} {name!r}: pages are whole numbers from 0")
                found[(kind, name)] = Quota(guaranteed, limit)
    except (AttributeError, TypeError, ValueError) as exc:
        raise QuotaError(f"the quotas kept in {path} are not what memd writes ({exc}); remove the file to start "
                         "from --quotas alone") from None
    return found
