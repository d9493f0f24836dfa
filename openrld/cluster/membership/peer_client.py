"""Push-pull over the peer HTTP API: `POST {peer_url}/openrl/peer/v1/pushpull`.

The body is the msgpack `PushPull`; its cluster-secret tag goes in the
`X-Openrl-Cluster-Tag` header, and the answer carries its own tag the same
way (the node checks both, in codec.py). This module only moves bytes: it
never decodes a state and never retries (the push-pull loop tries again next
round). Timeouts are the caller's, as a trio cancel scope around `exchange`.
"""

from __future__ import annotations

import httpx

from openrld.cluster.membership.codec import MAX_PUSH_PULL_BYTES
from openrld.cluster.membership.transport import PeerUnreachable

PUSH_PULL_PATH = "/openrl/peer/v1/pushpull"
TAG_HEADER = "X-Openrl-Cluster-Tag"
CONTENT_TYPE = "application/x-openrl-gossip+msgpack"


class HttpPushPull:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def exchange(self, peer_url: str, body: bytes, tag_hex: str) -> tuple[bytes, str]:
        url = peer_url.rstrip("/") + PUSH_PULL_PATH
        try:
            response = await self._client.post(
                url, content=body, headers={TAG_HEADER: tag_hex, "Content-Type": CONTENT_TYPE}
            )
        except httpx.HTTPError as exc:
            raise PeerUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise PeerUnreachable(f"POST {url}: status {response.status_code}: {response.text[:200]}")
        if len(response.content) > MAX_PUSH_PULL_BYTES:
            raise PeerUnreachable(f"POST {url}: answer of {len(response.content)} bytes is over the limit")
        return response.content, response.headers.get(TAG_HEADER, "")
