"""Bearer-key parsing and verification (README §2.1, §2.2; api-ops §5.3).

Method: build an `AuthConfig` (directly, or through `load_config` where the TOML/env path
matters), turn it into a `KeyStore` with `KeyStore.from_config`, then observe the result
only through `authenticate()`: the returned `Principal`'s scopes and prefixes are the
meaning of an entry. Bad entries must raise `ConfigError` naming where the entry came from
and never echoing the secret. Plaintext retention is checked by walking every object the
store references.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from topicd.config import AuthConfig, ConfigError, HashedKey, hash_secret, load_config
from topicd.http.auth import ALL_SCOPES, KeyStore, Principal

SECRET = "s3cret"


def store(*entries: str, **kw) -> KeyStore:
    return KeyStore.from_config(AuthConfig(api_keys=entries, **kw))


def who(ks: KeyStore, token: str = SECRET) -> Principal:
    p = ks.authenticate(f"Bearer {token}")
    assert p is not None
    return p


R, W, D, A = "read", "write", "delete", "admin"


# --------------------------------------------------------------------------------------
# Entry syntax
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "scopes", "prefixes"),
    [
        ("s3cret", ALL_SCOPES, ()),
        ("s3cret:read", {R}, ()),
        ("s3cret:r", {R}, ()),
        ("s3cret:write", {W}, ()),
        ("s3cret:w", {W}, ()),
        ("s3cret:delete", {D}, ()),
        ("s3cret:del", {D}, ()),
        ("s3cret:d", {D}, ()),
        ("s3cret:admin", {A}, ()),
        ("s3cret:a", {A}, ()),
        ("s3cret:rw", {R, W}, ()),
        ("s3cret:RW", {R, W}, ()),
        ("s3cret:Read+WRITE", {R, W}, ()),
        ("s3cret:r+w+d+a", ALL_SCOPES, ()),
        ("s3cret:rw+del", {R, W, D}, ()),
        ("s3cret:r++w+", {R, W}, ()),
        ("s3cret:+a", {A}, ()),
        ("s3cret:", ALL_SCOPES, ()),
        ("s3cret:r:tenant42:", {R}, ("tenant42:",)),
        ("s3cret:r:tenant42:|shared.", {R}, ("tenant42:", "shared.")),
        ("s3cret:w:ns:sub:deep", {W}, ("ns:sub:deep",)),
        ("s3cret::tenant42:", ALL_SCOPES, ("tenant42:",)),
        ("s3cret::a|b", ALL_SCOPES, ("a", "b")),
        ("s3cret:r:", {R}, ()),
        ("s3cret:r:a||b|", {R}, ("a", "b")),
        ("  s3cret:r:t.  ", {R}, ("t.",)),
    ],
)
def test_entry_syntax(entry, scopes, prefixes):
    p = who(store(entry))
    assert p.scopes == frozenset(scopes)
    assert p.prefixes == prefixes


@pytest.mark.parametrize(
    "entry",
    ["s3cret:bogus", "s3cret:r+bogus", "s3cret:readwrite", "s3cret:wr", "s3cret:all:t."],
)
def test_unknown_scope_token_refuses(entry):
    with pytest.raises(ConfigError) as exc:
        store("ok:r", entry)
    msg = str(exc.value)
    assert "auth.api_keys[1]" in msg
    assert SECRET not in msg


def test_empty_secret_refuses():
    with pytest.raises(ConfigError, match=r"auth\.api_keys\[0\]"):
        store(":r")


def test_empty_entries_are_ignored():
    ks = store("", "   ", "s3cret:r")
    assert len(ks) == 1


def test_prefix_match_is_a_raw_byte_prefix():
    p = who(store("s3cret:r:tenant42:|shared."))
    assert p.allows_name("tenant42:orders")
    assert p.allows_name("tenant42:")
    assert p.allows_name("shared.x")
    assert not p.allows_name("tenant4")
    assert not p.allows_name("Tenant42:orders")
    assert not p.allows_name("sharedx")
    assert who(store("s3cret")).allows_name("anything")


def test_secret_is_only_the_text_before_the_first_colon():
    ks = store("s3cret:rw:t.")
    assert ks.authenticate("Bearer s3cret:rw:t.") is None
    assert ks.authenticate("Bearer s3cret:rw") is None
    assert who(ks).scopes == {R, W}


def test_several_keys_each_keep_their_own_rights():
    ks = store("reader:r:pub.", "writer:w", "boss")
    assert who(ks, "reader").scopes == {R}
    assert who(ks, "reader").prefixes == ("pub.",)
    assert who(ks, "writer").scopes == {W}
    assert who(ks, "boss").scopes == ALL_SCOPES
    assert len(ks) == 3
    assert ks.enabled


def test_keys_from_env_list(tmp_path):
    cfg = load_config(None, env={"TOPICD_API_KEYS": "a:r, b:w:t.,"}, flags={})
    ks = KeyStore.from_config(cfg.auth)
    assert who(ks, "a").scopes == {R}
    assert who(ks, "b").prefixes == ("t.",)


def test_no_keys_is_dev_mode():
    ks = KeyStore.from_config(AuthConfig())
    assert not ks.enabled
    assert len(ks) == 0
    assert ks.authenticate(f"Bearer {SECRET}") is None


# --------------------------------------------------------------------------------------
# Duplicates
# --------------------------------------------------------------------------------------


def test_duplicate_secret_is_an_error_even_with_other_scopes():
    with pytest.raises(ConfigError, match="duplicate") as exc:
        store("s3cret:r", "s3cret:w")
    assert SECRET not in str(exc.value)


def test_duplicate_between_entry_and_hashed_key():
    with pytest.raises(ConfigError, match="duplicate"):
        store("s3cret", key=(HashedKey(hash_secret(SECRET)),))


def test_duplicate_between_hashed_keys_in_either_case():
    digest = hash_secret(SECRET)
    with pytest.raises(ConfigError, match="duplicate"):
        store(key=(HashedKey(digest), HashedKey(digest.upper())))


def test_duplicate_between_file_and_list(tmp_path):
    path = tmp_path / "keys"
    path.write_text("s3cret:r\n")
    with pytest.raises(ConfigError, match="duplicate"):
        store("s3cret:w", api_keys_file=str(path))


# --------------------------------------------------------------------------------------
# api_keys_file
# --------------------------------------------------------------------------------------


def test_api_keys_file_with_comments_is_appended(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        "# topicd keys\n"
        "\n"
        "ingest:w:tenant42:\n"
        "   # indented comment\n"
        "  dash:read:tenant42:|shared.  \n"
        "ops::\n"
    )
    ks = store("inline:r", api_keys_file=str(path))
    assert len(ks) == 4
    assert who(ks, "inline").scopes == {R}
    assert who(ks, "ingest").scopes == {W}
    assert who(ks, "ingest").prefixes == ("tenant42:",)
    assert who(ks, "dash").prefixes == ("tenant42:", "shared.")
    assert who(ks, "ops").scopes == ALL_SCOPES
    assert who(ks, "ops").prefixes == ()
    assert ks.authenticate("Bearer # topicd keys") is None


def test_api_keys_file_bad_entry_names_the_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# header\ngood:r\ns3cret:superuser\n")
    with pytest.raises(ConfigError) as exc:
        store(api_keys_file=str(path))
    msg = str(exc.value)
    assert "auth.api_keys_file" in msg
    assert "line 3" in msg
    assert SECRET not in msg


def test_api_keys_file_missing_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"auth\.api_keys_file"):
        store(api_keys_file=str(tmp_path / "absent"))


def test_api_keys_file_from_toml(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("s3cret:rw\n")
    conf = tmp_path / "topicd.toml"
    conf.write_text(f'[auth]\napi_keys_file = "{keys}"\n')
    ks = KeyStore.from_config(load_config(conf, env={}, flags={}).auth)
    assert who(ks).scopes == {R, W}


# --------------------------------------------------------------------------------------
# Pre-hashed keys
# --------------------------------------------------------------------------------------


def test_hashed_key_with_scopes_and_prefixes():
    ks = store(key=(HashedKey(hash_secret(SECRET), ("read",), ("tenant42:", "shared.")),))
    p = who(ks)
    assert p.scopes == {R}
    assert p.prefixes == ("tenant42:", "shared.")


def test_hashed_key_empty_lists_is_full_access():
    p = who(store(key=(HashedKey(hash_secret(SECRET), (), ()),)))
    assert p.scopes == ALL_SCOPES
    assert p.prefixes == ()


def test_hashed_key_scope_tokens_are_the_entry_tokens():
    p = who(store(key=(HashedKey(hash_secret(SECRET), ("RW", "d")),)))
    assert p.scopes == {R, W, D}


def test_hashed_key_unknown_scope_refuses():
    with pytest.raises(ConfigError, match=r"auth\.key\[0\]"):
        store(key=(HashedKey(hash_secret(SECRET), ("root",)),))


def test_hashed_key_from_toml(tmp_path):
    conf = tmp_path / "topicd.toml"
    conf.write_text(
        f'[[auth.key]]\nsha256 = "{hash_secret(SECRET).upper()}"\n'
        'scopes = ["read"]\nprefixes = ["tenant42:"]\n'
    )
    ks = KeyStore.from_config(load_config(conf, env={}, flags={}).auth)
    assert who(ks).scopes == {R}
    assert who(ks).prefixes == ("tenant42:",)


def test_hash_secret_is_sha256_hex():
    assert hash_secret(SECRET) == hashlib.sha256(SECRET.encode()).hexdigest()


# --------------------------------------------------------------------------------------
# authenticate()
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [f"Bearer {SECRET}", f"Bearer   {SECRET}", f"Bearer {SECRET}  ", f"Bearer \t{SECRET}\t"],
)
def test_authenticate_accepts_trimmed_token(header):
    assert store(SECRET).authenticate(header) is not None


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        SECRET,
        f"bearer {SECRET}",
        f"BEARER {SECRET}",
        f"Bearer\t{SECRET}",
        f"Bearer{SECRET}",
        f" Bearer {SECRET}",
        f"Basic {SECRET}",
        "Bearer ",
        "Bearer    ",
        "Bearer wrong",
        f"Bearer {SECRET.upper()}",
        f"Bearer {SECRET}x",
    ],
)
def test_authenticate_rejects(header):
    assert store(SECRET).authenticate(header) is None


def test_authenticate_token_for_query_fallback():
    ks = store(SECRET)
    assert ks.authenticate_token(f" {SECRET} ") is not None
    assert ks.authenticate_token("") is None


# --------------------------------------------------------------------------------------
# Plaintext is not retained
# --------------------------------------------------------------------------------------


def _reachable(obj, seen=None):
    """Every object reachable from `obj` through attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, str | bytes | int | float | bool | type(None)):
        return
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set | frozenset):
        children = list(obj)
    elif dataclasses.is_dataclass(obj):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ())]
    for child in children:
        yield from _reachable(child, seen)


def test_keystore_holds_only_digests(tmp_path):
    path = tmp_path / "keys"
    path.write_text("filesecret:r\n")
    ks = store(f"{SECRET}:rw:tenant42:", api_keys_file=str(path))
    plaintexts = (SECRET, "filesecret")
    for obj in _reachable(ks):
        if isinstance(obj, str):
            assert all(s not in obj for s in plaintexts), obj
        if isinstance(obj, bytes):
            assert all(s.encode() not in obj for s in plaintexts), obj
    digests = {o for o in _reachable(ks) if isinstance(o, bytes)}
    assert digests == {hashlib.sha256(s.encode()).digest() for s in plaintexts}
    assert SECRET not in repr(who(ks))
