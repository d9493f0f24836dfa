"""tinker.py's bootstrap handlers, driven in a quart request context with a node's config and keys
and no daemon: what each answers, and what it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from quart_trio import QuartTrio

from openrld import __version__
from openrld.api import tinker
from openrld.api.app import Services
from openrld.api.asgi import Reply
from openrld.api.auth import Authenticator
from openrld.config import NodeConfig
from openrld.errors import BadRequest, Unauthorized


@dataclass
class _Entry:
    name: str
    max_context: int


@dataclass
class _Listed:
    entry: _Entry
    is_ready: bool


class _Catalog:
    """The model catalog's one read the capabilities route makes."""

    def listed(self) -> list[_Listed]:
        return [_Listed(_Entry("tiny-llama", 2048), True), _Listed(_Entry("gemma-3-1b", 8192), False)]


def services(keys: dict[str, str] | None = None) -> Services:
    """What the bootstrap routes read: the node's config, its keys and its catalog; no actors."""
    return Services(
        config=NodeConfig(data_dir=Path("/nonexistent")), auth=Authenticator(keys), catalog=_Catalog(),
        futures=None, jobs=None, sessions=None, sampling=None, groups=None, checkpoints=None, records=None,
    )


async def answer(handler, node: Services, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    app = QuartTrio("test")
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with app.test_request_context("/", method="POST", data=body, headers=headers):
        reply: Reply = await handler(node)
        return reply.status, reply.body


async def test_client_config_tells_sdk_0_21_to_0_24_to_send_forward_backward_as_protobuf() -> None:
    assert await answer(tinker.client_config, services(), b'{"sdk_version": "0.24.1"}') == (
        200, b'{"proto_write_fwdbwd":true,"fwd_via_fwdbwd":true}'
    )


async def test_client_config_leaves_sdk_0_25_at_its_defaults() -> None:
    assert await answer(tinker.client_config, services(), b'{"sdk_version": "0.25.0"}') == (200, b"{}")


async def test_client_config_without_an_sdk_version_is_a_bad_request_naming_it() -> None:
    with pytest.raises(BadRequest) as refused:
        await answer(tinker.client_config, services(), b"{}")
    assert refused.value.detail == "invalid ClientConfigRequest body: Object missing required field `sdk_version`"


async def test_a_node_with_keys_refuses_a_call_without_one() -> None:
    with pytest.raises(Unauthorized) as refused:
        await answer(tinker.client_config, services({"tml-a": "alice"}), b'{"sdk_version": "0.25.0"}')
    assert refused.value.detail == "missing X-API-Key header"


async def test_healthz_answers_the_version_without_a_key() -> None:
    status, body = await answer(tinker.healthz, services({"tml-a": "alice"}))
    assert (status, body) == (200, b'{"status":"ok","version":"%s"}' % __version__.encode())


async def test_capabilities_list_every_catalog_model_and_whether_its_files_are_ready() -> None:
    status, body = await answer(tinker.get_server_capabilities, services())
    assert (status, body) == (200, (
        b'{"supported_models":['
        b'{"model_name":"tiny-llama","max_context_length":2048,"trainable":true,"sampleable":true,"ready":true},'
        b'{"model_name":"gemma-3-1b","max_context_length":8192,"trainable":true,"sampleable":true,"ready":false}]}'
    ))
