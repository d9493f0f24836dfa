"""Signed download URLs and JWTs: what verifies, and what is refused."""

from __future__ import annotations

import pytest

from openrld.api.signing import Signer
from openrld.errors import InvalidToken, NotFound

PATH = "/api/v1/download/s-1:train:0/external_weights/ext/adapter_config.json"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _query(signed: str) -> tuple[str, str]:
    query = dict(part.split("=") for part in signed.split("?", 1)[1].split("&"))
    return query["expires"], query["sig"]


def test_a_signed_path_verifies_until_it_expires() -> None:
    clock = Clock()
    signer = Signer(b"k" * 32, now=clock)
    signed, expires = signer.sign_path(PATH, 60)
    assert expires == 1_000_060
    signer.check_path(PATH, *_query(signed))
    clock.now = 1_000_061.0
    with pytest.raises(NotFound, match="expired"):
        signer.check_path(PATH, *_query(signed))


@pytest.mark.parametrize("tamper", ["path", "expires", "sig", "secret"])
def test_a_tampered_signed_path_is_refused(tamper: str) -> None:
    signer = Signer(b"k" * 32, now=Clock())
    expires, sig = _query(signer.sign_path(PATH, 60)[0])
    path = PATH.replace("adapter_config.json", "adapter_model.safetensors") if tamper == "path" else PATH
    expires = str(int(expires) + 1) if tamper == "expires" else expires
    sig = ("0" if sig[0] != "0" else "1") + sig[1:] if tamper == "sig" else sig
    checker = Signer(b"j" * 32, now=Clock()) if tamper == "secret" else signer
    with pytest.raises(NotFound, match="bad signature"):
        checker.check_path(path, expires, sig)


def test_a_minted_jwt_names_its_user_until_it_expires() -> None:
    clock = Clock()
    signer = Signer(b"k" * 32, now=clock)
    token = signer.mint_jwt("alice", 3600, org_id="openrld", email=None)
    assert token.startswith("eyJ")
    assert signer.user_of_jwt(token) == "alice"
    clock.now += 3600
    with pytest.raises(InvalidToken, match="expired"):
        signer.user_of_jwt(token)


def test_a_jwt_signed_by_another_secret_is_refused() -> None:
    token = Signer(b"j" * 32, now=Clock()).mint_jwt("alice", 3600, org_id="openrld", email=None)
    with pytest.raises(InvalidToken, match="does not verify"):
        Signer(b"k" * 32, now=Clock()).user_of_jwt(token)
