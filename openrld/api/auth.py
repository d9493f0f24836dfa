"""Who is calling: the `X-API-Key` header mapped to a user.

Two modes. With a key file, each key belongs to a user and an unknown or
missing key is a 401. Without one (open mode, for a single researcher's
machine; the daemon then binds to loopback by default) every caller is the
user `local`, though the SDK still sends some `tml-` key, which is accepted.

With the JWT exchange on (config `jwt_auth`), a JWT that this node signed
(`/api/v1/auth/token`) is accepted in place of the key it was exchanged for.

The operator: the user named ADMIN_USER in the key file sees every user's
runs in the console's read-only views (`sees_all`); it owns nothing else of
theirs, so every other route treats it as any user. In open mode the one user
sees all, since all there is is theirs.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

from openrld.api.signing import Signer
from openrld.errors import Unauthorized

OPEN_MODE_USER = "local"
# A key file names users; giving a key to this one makes its holder the operator. A name and
# not a config setting: the key file is already the one place that says who is who.
ADMIN_USER = "admin"
# The ASGI scope's entry for the user the gate found, so that no later layer asks for it again.
SCOPE_USER = "openrld.user"


class Authenticator:
    def __init__(self, keys: dict[str, str] | None, *, jwt_signer: Signer | None = None) -> None:
        self._keys = dict(keys) if keys is not None else None
        self._jwt_signer = jwt_signer

    @property
    def jwt_enabled(self) -> bool:
        return self._jwt_signer is not None

    def key_id(self, api_key: str | None) -> int | None:
        """The 1-based position of a key in the key file (its `key_id` for the CLI); None in open mode."""
        if self._keys is None or not api_key:
            return None
        for number, known in enumerate(self._keys, start=1):
            if hmac.compare_digest(known.encode(), api_key.encode()):
                return number
        return None

    @property
    def is_open(self) -> bool:
        return self._keys is None

    def sees_all(self, user: str) -> bool:
        """Whether `user` may read every user's runs (the console's operator views)."""
        return self._keys is None or user == ADMIN_USER

    def user_for(self, api_key: str | None) -> str:
        """The user a request acts as.

        Raises:
            Unauthorized: key-file mode and the key is missing or unknown.
        """
        if api_key and self._jwt_signer is not None and api_key.startswith("eyJ"):
            return self._jwt_signer.user_of_jwt(api_key)
        if self._keys is None:
            return OPEN_MODE_USER
        if not api_key:
            raise Unauthorized("missing X-API-Key header")
        for known, user in self._keys.items():
            # Constant-time compare, so key guessing learns nothing from timing.
            if hmac.compare_digest(known.encode(), api_key.encode()):
                return user
        raise Unauthorized("unknown API key")


def user_in(scope: Mapping[str, Any], api_key: str | None, user_for: Callable[[str | None], str]) -> str:
    """The caller's user: the one the gate left in `scope`, or `user_for(api_key)` where it left none
    (open mode, a keyless path, a layer driven without the gate).

    Raises:
        Unauthorized: as `Authenticator.user_for`.
    """
    user = scope.get(SCOPE_USER)
    return user if user is not None else user_for(api_key)
