"""Signed manifests: an HMAC-SHA256 over a checkpoint's manifest, which lists every file's size and SHA-256.

A manifest's checksums catch corruption, not tampering: it sits beside the files
it vouches for, so whoever can rewrite a file can rewrite its hash. With a
signing key (``checkpoint.signing_key`` or ``RAYSC_CHECKPOINT_KEY``) every
manifest carries ``signature = {alg, key_id, value}``: ``value`` is
HMAC-SHA256(key, canonical JSON of the manifest without its signature), and
``key_id`` is the first 12 hex digits of SHA-256(key), which says which key
signed without revealing it. A restore checks the signature, then each file's
SHA-256, before any byte of the checkpoint is parsed.

Rotation: sign with the new key and keep the old one in
``RAYSC_CHECKPOINT_PREVIOUS_KEYS`` (comma-separated) until checkpoints signed
with it have aged out of retention; previous keys verify, they never sign.
The key never appears in configs written to disk, manifests, events or logs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field

from raysc.config.secrets import REDACTED

ALG = "hmac-sha256"
KEY_ENV = "RAYSC_CHECKPOINT_KEY"
PREVIOUS_KEYS_ENV = "RAYSC_CHECKPOINT_PREVIOUS_KEYS"
MIN_KEY_CHARS = 16


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def canonical(manifest: dict) -> bytes:
    """The bytes that are signed: the manifest without ``signature``, keys sorted, no whitespace."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: str, manifest: dict) -> str:
    return hmac.new(key.encode(), canonical(manifest), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Signer:
    """The key that signs new manifests (may be absent) and the keys that verify them."""

    key: str = field(default="", repr=False)
    previous: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def resolve(cls, configured: str = "") -> Signer:
        """The key from the config, or ``RAYSC_CHECKPOINT_KEY`` when the config has none (or holds a
        redacted one, as a run's saved config.toml does); previous keys from the environment."""
        key = configured if configured and configured != REDACTED else os.environ.get(KEY_ENV, "")
        if configured == REDACTED and not key:
            raise ValueError(
                f"this config comes from a run that signs its checkpoints (checkpoint.signing_key "
                f"is redacted on disk): set {KEY_ENV} to that key so they can be verified"
            )
        previous = tuple(k.strip() for k in os.environ.get(PREVIOUS_KEYS_ENV, "").split(",") if k.strip())
        if key and len(key) < MIN_KEY_CHARS:
            raise ValueError(
                f"checkpoint.signing_key is {len(key)} characters: use at least {MIN_KEY_CHARS} "
                f"random ones, e.g. `openssl rand -hex 32`"
            )
        return cls(key, previous)

    @property
    def enabled(self) -> bool:
        return bool(self.key)

    def sign(self, manifest: dict) -> dict:
        """``manifest`` with a signature added (unchanged without a key). The manifest is round-tripped
        through JSON first, so what is signed is exactly what a reader will parse."""
        if not self.key:
            return manifest
        body = json.loads(json.dumps(manifest))
        body["signature"] = {"alg": ALG, "key_id": key_id(self.key), "value": _mac(self.key, body)}
        return body

    def check(self, manifest: dict) -> str | None:
        """None when the manifest may be trusted under this signer's policy; else why not.
        Without a key nothing is required (a signed manifest is then merely not verified)."""
        if not self.key:
            return None
        if not isinstance(manifest.get("signature"), dict):
            return (
                f"unsigned, and this run requires signed checkpoints ({KEY_ENV} / checkpoint.signing_key "
                f"is set): refused before parsing any file"
            )
        return self._verify(manifest)

    def _verify(self, manifest: dict) -> str | None:
        sig = manifest["signature"]
        if sig.get("alg") != ALG:
            return f"signature algorithm {sig.get('alg')!r} is not {ALG!r}: refused"
        keys = {key_id(k): k for k in (*self.previous, self.key) if k}
        key = keys.get(sig.get("key_id", ""))
        if key is None:
            return (
                f"signed with another key (key id {sig.get('key_id')!r}, this run has "
                f"{sorted(keys)}): after a rotation put the old key in {PREVIOUS_KEYS_ENV}"
            )
        if not hmac.compare_digest(str(sig.get("value", "")), _mac(key, manifest)):
            return "bad signature: the manifest was altered after it was signed (or forged): refused"
        return None

    def describe(self, manifest: dict) -> str:
        """Signature state for ``raysc ckpt list/verify``: unsigned, signed (verified / not verified / bad)."""
        sig = manifest.get("signature")
        if not isinstance(sig, dict):
            return "unsigned"
        if not self.key and not self.previous:
            return f"signed by key {sig.get('key_id')}, not verified (no {KEY_ENV} set)"
        verdict = self._verify(manifest)
        return f"signed by key {sig.get('key_id')}, verified" if verdict is None else f"BAD SIGNATURE: {verdict}"
