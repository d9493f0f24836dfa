"""Short-lived signed URLs and signed JWTs, both HMAC-SHA256 under one node secret.

Owns the two credentials openrld mints itself:
- download URLs (`?expires=<unix s>&sig=<hex>`) for external weights and
  session traces, which a plain HTTP GET with no API key may fetch until they
  expire; the signature covers the path and the expiry, so neither can be
  changed;
- JWTs (HS256) for the SDK's JWT exchange (`/api/v1/auth/token`), carrying
  `sub`, `org_id`, `email`, `iat` and `exp`.

It guarantees constant-time signature checks and that an expired or altered
credential is refused. It never touches the filesystem and never decides who
may see what: routes do that before they sign.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from urllib.parse import quote

import msgspec

from openrld.errors import InvalidToken, NotFound

JWT_HEADER = {"alg": "HS256", "typ": "JWT"}


class JwtClaims(msgspec.Struct, frozen=True):
    sub: str  # "tml:user:<user>"
    org_id: str
    iat: int
    exp: int
    email: str | None = None


def user_urn(user: str) -> str:
    return f"tml:user:{user}"


def user_of_urn(urn: str) -> str | None:
    prefix = "tml:user:"
    return urn[len(prefix) :] if urn.startswith(prefix) else None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """HMAC-SHA256 under one secret; `now` is the wall clock in Unix seconds (tests pass their own)."""

    def __init__(self, secret: bytes | None = None, *, now: Callable[[], float] = time.time) -> None:
        # A fresh secret per process: URLs and tokens are short-lived, and a
        # restart revoking them is the safe side (the SDK re-exchanges tokens).
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._now = now

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    # ------------------------------------------------------------ URLs

    def sign_path(self, path: str, ttl_s: int) -> tuple[str, int]:
        """(path with `?expires=..&sig=..`, expiry in Unix seconds) for a URL path like `/api/v1/download/...`."""
        expires = int(self._now()) + ttl_s
        sig = self._mac(f"{path}\n{expires}".encode()).hex()
        return f"{quote(path, safe='/:')}?expires={expires}&sig={sig}", expires

    def check_path(self, path: str, expires: str | None, sig: str | None) -> None:
        """Accept a signed URL's path, expiry and signature, or raise NotFound.

        A bad or expired signature answers 404 like a missing file, so a URL
        reveals nothing once it is no longer valid.
        """
        if expires is None or sig is None or not expires.isdigit():
            raise NotFound(f"no download at {path} (missing or malformed signature)")
        expected = self._mac(f"{path}\n{int(expires)}".encode()).hex()
        if not hmac.compare_digest(expected, sig):
            raise NotFound(f"no download at {path} (bad signature)")
        if int(expires) < self._now():
            raise NotFound(f"no download at {path} (the signed URL expired)")

    # ------------------------------------------------------------ JWTs

    def mint_jwt(self, user: str, ttl_s: int, *, org_id: str, email: str | None) -> str:
        now = int(self._now())
        claims = JwtClaims(sub=user_urn(user), org_id=org_id, iat=now, exp=now + ttl_s, email=email)
        head = _b64(json.dumps(JWT_HEADER, separators=(",", ":")).encode())
        body = _b64(msgspec.json.encode(claims))
        return f"{head}.{body}.{_b64(self._mac(f'{head}.{body}'.encode()))}"

    def user_of_jwt(self, token: str) -> str:
        """The user a JWT this signer minted names.

        Raises:
            InvalidToken: malformed, signed by someone else, or expired.
        """
        parts = token.split(".")
        if len(parts) != 3:
            raise InvalidToken("malformed JWT: expected three '.'-separated parts")
        head, body, sig = parts
        try:
            given = _unb64(sig)
            claims = msgspec.json.decode(_unb64(body), type=JwtClaims)
        except (ValueError, msgspec.DecodeError) as exc:
            raise InvalidToken(f"malformed JWT: {exc}") from None
        if not hmac.compare_digest(self._mac(f"{head}.{body}".encode()), given):
            raise InvalidToken("JWT signature does not verify")
        if claims.exp <= self._now():
            raise InvalidToken("JWT expired")
        user = user_of_urn(claims.sub)
        if user is None:
            raise InvalidToken(f"JWT sub {claims.sub!r} is not a tml:user: URN")
        return user
