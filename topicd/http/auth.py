"""Bearer-key authentication and authorization (README §2).

Keys come from `auth.api_keys` (env `TOPICD_API_KEYS` / `TOPICS_API_KEYS`), the lines of
`auth.api_keys_file` and the pre-hashed `[[auth.key]]` tables. Only `SHA-256(secret)` is
kept; the plaintext is dropped as soon as the entry is parsed and never logged.
Verification hashes the presented token and compares it against *every* stored digest with
a constant-time compare and no early exit, so timing reveals neither which key matched nor
how many exist.

No keys anywhere means dev mode: every request acts as the full-access principal.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

from topicd.config import AuthConfig, ConfigError, read_api_keys_file
from topicd.errors import Forbidden, Unauthorized

ALL_SCOPES: Final = frozenset({"read", "write", "delete", "admin"})
_SCOPE_TOKENS: Final = {
    "read": {"read"},
    "r": {"read"},
    "write": {"write"},
    "w": {"write"},
    "delete": {"delete"},
    "del": {"delete"},
    "d": {"delete"},
    "admin": {"admin"},
    "a": {"admin"},
    "rw": {"read", "write"},
}


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a key's id (digest prefix, safe to log), scopes and name prefixes."""

    key_id: str
    scopes: frozenset[str]
    prefixes: tuple[str, ...]  # empty = any name

    def allows_name(self, name: str) -> bool:
        if not self.prefixes:
            return True
        return any(name.startswith(p) for p in self.prefixes)

    def has(self, scope: str) -> bool:
        return scope in self.scopes

    def require(self, scope: str, *names: str, detail_key: str = "topic") -> None:
        """`403 forbidden` unless this key has `scope` and every name is in its allowlist."""
        if scope not in self.scopes:
            raise Forbidden(f"this key lacks the {scope} scope", {"scope": scope})
        for name in names:
            if not self.allows_name(name):
                raise Forbidden(
                    f"{detail_key} {name!r} is outside this key's prefixes", {detail_key: name}
                )


DEV_PRINCIPAL: Final = Principal("dev", ALL_SCOPES, ())


def parse_scopes(field: str, where: str) -> frozenset[str]:
    """`read+w` → {read, write}; empty = all four; unknown token ⇒ ConfigError (fail closed)."""
    if not field.strip():
        return ALL_SCOPES
    scopes: set[str] = set()
    tokens = [t.strip().lower() for t in field.split("+")]
    tokens = [t for t in tokens if t]
    if not tokens:  # e.g. "+": not empty, yet names nothing — refuse rather than grant all
        raise ConfigError(f"{where}: the scopes field {field!r} names no scope")
    for tok in tokens:
        if tok not in _SCOPE_TOKENS:
            raise ConfigError(f"{where}: unknown scope token {tok!r}")
        scopes |= _SCOPE_TOKENS[tok]
    return frozenset(scopes)


def parse_prefixes(items: list[str], where: str) -> tuple[str, ...]:
    """Empty items are dropped; a field of only separators refuses (it names nothing)."""
    prefixes = tuple(p for p in items if p)
    if not prefixes and len(items) > 1:  # e.g. "|"
        raise ConfigError(f"{where}: the prefixes field names no prefix")
    return prefixes


def parse_key_entry(entry: str, where: str) -> tuple[bytes, Principal]:
    """`secret[:scopes[:prefixes]]` → (sha256 digest, principal). The secret is dropped."""
    entry = entry.strip()
    parts = entry.split(":", 2)
    secret = parts[0]
    if not secret:
        raise ConfigError(f"{where}: empty secret")
    scopes = parse_scopes(parts[1], where) if len(parts) > 1 else ALL_SCOPES
    prefixes: tuple[str, ...] = ()
    if len(parts) > 2:
        prefixes = parse_prefixes(parts[2].split("|"), where)
    digest = hashlib.sha256(secret.encode("utf-8")).digest()
    return digest, Principal(digest.hex()[:12], scopes, prefixes)


class KeyStore:
    """All configured keys, as digests."""

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        seen: set[bytes] = set()
        for digest, _ in entries:
            if digest in seen:
                raise ConfigError(f"auth: duplicate key (digest {digest.hex()[:12]}…)")
            seen.add(digest)
        self._entries = entries

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def from_config(cls, auth: AuthConfig) -> KeyStore:
        """Parse every key source; raises ConfigError naming the bad entry (never the secret)."""
        entries: list[tuple[bytes, Principal]] = []
        for i, raw in enumerate(auth.api_keys):
            if raw.strip():
                entries.append(parse_key_entry(raw, f"auth.api_keys[{i}]"))
        for lineno, line in enumerate(read_api_keys_file(auth), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append(parse_key_entry(line, f"auth.api_keys_file line {lineno}"))
        for i, hk in enumerate(auth.key):
            where = f"auth.key[{i}]"
            if hk.scopes and not any(s.strip() for s in hk.scopes):
                raise ConfigError(f"{where}.scopes: names no scope")
            scopes = parse_scopes("+".join(hk.scopes), where)
            if hk.prefixes and not any(hk.prefixes):
                raise ConfigError(f"{where}.prefixes: names no prefix")
            prefixes = tuple(p for p in hk.prefixes if p)
            entries.append((bytes.fromhex(hk.sha256), Principal(hk.sha256[:12], scopes, prefixes)))
        return cls(entries)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal for an `Authorization` header value, or None if not a valid key."""
        if authorization is None or not authorization.startswith("Bearer "):
            return None
        return self.authenticate_token(authorization[7:])

    def authenticate_token(self, token: str) -> Principal | None:
        token = token.strip()
        if not token:
            return None
        presented = hashlib.sha256(token.encode("utf-8")).digest()
        found: Principal | None = None
        for digest, principal in self._entries:  # every digest, no early exit
            if hmac.compare_digest(digest, presented):
                found = principal
        return found


def stream_principal(
    keys: KeyStore, headers: dict[bytes, str], query: dict[str, list[str]]
) -> Principal:
    """The principal of a stream request served before the gate (`/work`, the dashboard
    feed): the `Authorization` header, or `?token=` (browsers' EventSource cannot set
    headers); the header wins when both are present."""
    if not keys.enabled:
        return DEV_PRINCIPAL
    auth = headers.get(b"authorization")
    if auth is not None:
        p = keys.authenticate(auth)
    elif "token" in query:
        p = keys.authenticate_token(query["token"][0])
    else:
        raise Unauthorized("missing bearer key (header, or ?token= on this stream)")
    if p is None:
        raise Unauthorized("unknown or malformed bearer key")
    return p
