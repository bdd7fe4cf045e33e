"""The connector's settings, from vLLM's `kv_connector_extra_config`: checked whole at start-up.

A setting vLLM's user mistyped must stop vLLM at start-up with one line that
says which and why, not be ignored (a connector that silently talks to the
wrong memd serves with no hits) nor fail later inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIMEOUT_S = 2.0             # longest wait for memd in an engine step before going on without it


class SettingsError(ValueError):
    """The extra config cannot be used; the message is the one line vLLM's user reads."""


@dataclass(frozen=True, slots=True)
class Settings:
    memd_address: str | None = None      # memd's gRPC target; None: where memd listens by default on this host
    timeout_s: float = TIMEOUT_S
    tenant: str = ""                     # the tenant of requests that name none in kv_transfer_params

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {"memd_address": str, "timeout_s": (int, float), "tenant": str}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise SettingsError(f"kvpool connector: unknown kv_connector_extra_config key {unknown[0]!r}; "
                                f"known: {', '.join(sorted(known))}")
        for key, kind in known.items():
            if key in extra and (not isinstance(extra[key], kind) or isinstance(extra[key], bool)):
                raise SettingsError(f"kvpool connector: kv_connector_extra_config {key!r} must be a "
                                    f"{'number' if key == 'timeout_s' else 'string'}, not {extra[key]!r}")
        timeout_s = float(extra.get("timeout_s", TIMEOUT_S))
        if not 0 < timeout_s <= 60:
            raise SettingsError(f"kvpool connector: timeout_s {timeout_s:g} must be above 0 and at most 60 seconds")
        return cls(extra.get("memd_address") or None, timeout_s, extra.get("tenant", ""))


def request_tenant(kv_transfer_params: dict[str, Any] | None, default: str) -> str:
    """The tenant a request names in its `kv_transfer_params` ({"tenant": "acme"}), else the default; a value
    that is not a string is ignored (vLLM's user gets served, uncounted to any tenant's name they did not give)."""
    tenant = (kv_transfer_params or {}).get("tenant", default)
    return tenant if isinstance(tenant, str) else default
