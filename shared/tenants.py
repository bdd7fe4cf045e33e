"""Who may call the HTTP API, and the namespace each caller's sessions and cached prefixes live in.

`--api-keys FILE` names tenants in TOML, one table each:

    [tenants.acme]
    keys = ["sk-acme-1", "sk-acme-2"]     # any of them is acme
    shared_prefix = false                 # true: its prompts share cached blocks with other such tenants
    admin = false                         # true: it may reset the prefix cache (POST /reset_prefix_cache)
    guaranteed_pages = 512                # memd's (memd --quotas FILE reads the same file): see memd.quotas
    max_pages = 2048

A tenant's sessions are its own: memd keeps them under the tenant's name
(`acme/chat`), so another tenant's `chat` is another session, and naming one
that is not yours is the 404 of a session that does not exist. A tenant's
cached prefixes are its own too: its prompts are salted with its name (beside
any `cache_salt` of the request), so a prompt another tenant sent never hits
its blocks (no timing side channel) and the cluster store keeps them under
other keys. Tenants with `shared_prefix = true` share one space, so a system
prompt they all send is stored once.

`--api-key KEY` is one tenant with that key and no name: sessions and salts
as without tenants, as before. No key at all: anyone may call, likewise.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from shared.http_exchange import ApiError
from shared.toml_file import read_toml

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FIELDS = {"keys", "shared_prefix", "admin"}
# memd's, read by memd --quotas from the same file (memd.quotas): inferd takes them and leaves them to memd.
QUOTA_FIELDS = {"guaranteed_pages", "max_pages"}


class TenantsError(ValueError):
    """An --api-keys file that cannot be used: one line says why."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str                       # "": the one tenant of --api-key (or of no key)
    keys: tuple[str, ...]
    shared_prefix: bool = False
    admin: bool = False

    def session(self, session_id: str | None) -> str | None:
        """The name memd keeps a session of this tenant's under."""
        if session_id is None or not self.name:
            return session_id
        return f"{self.name}/{session_id}"

    def salt(self, cache_salt: str | None) -> str | None:
        """The salt this tenant's prompt is cached under: its name's (unless it shares), then the request's."""
        return cache_salt if self.shared_prefix else tenant_salt(self.name, cache_salt)


def tenant_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The prefix space of `tenant`'s prompts salted by `cache_salt`: no other tenant's prompt finds them."""
    if not tenant:
        return cache_salt
    return f"tenant:{tenant}" + (f"/{cache_salt}" if cache_salt else "")


ANYONE = Tenant("", (), admin=True)       # a server with no key: nothing is anyone's more than another's


@dataclass(frozen=True, slots=True)
class Tenants:
    tenants: tuple[Tenant, ...]
    open: bool = False              # no key at all: every caller is ANYONE

    @classmethod
    def single(cls, key: str | None) -> Tenants:
        """--api-key KEY (one unnamed tenant), or no key (anyone)."""
        return cls((Tenant("", (key,), admin=True),)) if key else cls((), open=True)

    @classmethod
    def load(cls, path: Path) -> Tenants:
        data = read_toml(path, TenantsError)
        tables = data.get("tenants")
        if set(data) - {"tenants", "models"} or not isinstance(tables, dict) or not tables:
            raise TenantsError(f"{path}: expected [tenants.NAME] tables (and memd's [models.NAME]) and nothing else")
        tenants, owner = [], {}
        for name, table in tables.items():
            where = f"{path}: tenant {name!r}"
            if not NAME.fullmatch(name):
                raise TenantsError(f"{where}: a name is 1 to 64 letters, digits, '_', '.' or '-'")
            if not isinstance(table, dict) or set(table) - FIELDS - QUOTA_FIELDS:
                raise TenantsError(f"{where}: its fields are {', '.join(sorted(FIELDS | QUOTA_FIELDS))}")
            keys, shared, admin = table.get("keys"), table.get("shared_prefix", False), table.get("admin", False)
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise TenantsError(f"{where}: keys must be a list of one or more non-empty strings")
            if not isinstance(shared, bool) or not isinstance(admin, bool):
                raise TenantsError(f"{where}: shared_prefix and admin are true or false")
            for key in keys:
                if key in owner:
                    raise TenantsError(f"{where}: a key of it is {owner[key]!r}'s too")
                owner[key] = name
            tenants.append(Tenant(name, tuple(keys), shared, admin))
        return cls(tuple(tenants))

    def caller(self, authorization: str) -> Tenant:
        """The tenant whose key the Authorization header carries (`Bearer KEY`); a 401 if none's."""
        if self.open:
            return ANYONE
        scheme, _, given = authorization.partition(" ")
        given_bytes = given.strip().encode()
        found = None
        for tenant in self.tenants:          # every key compared in constant time, none skipped
            for key in tenant.keys:
                if hmac.compare_digest(given_bytes, key.encode()) and scheme.lower() == "bearer":
                    found = tenant
        if found is None:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
        return found
