"""A caller's session, carried signed with a request relayed to the node that will create a job of it.

A job or sampler may be placed on a node that has never seen its session (the
client created it elsewhere). The node that relays a creating request sends
the session along (`SESSION_HEADER`, base64 JSON of the `SessionSnapshot`),
tagged with the relay key (`SESSION_TAG_HEADER`), and the receiving node
records it only if the tag is right, so that no client can make up a session
by sending the header itself. Only creating requests carry it: every later
call for the job finds the session already there. Pure: no I/O, no trio.
"""

from __future__ import annotations

import base64
import hmac
import logging

import msgspec

from openrld.actors.sessions import SessionSnapshot
from openrld.cluster.peer_client import sign

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-openrl-session"  # base64 JSON SessionSnapshot
SESSION_TAG_HEADER = "x-openrl-session-tag"  # HMAC of SESSION_HEADER's value with the relay key


def session_headers(snapshot: SessionSnapshot, key: bytes) -> list[tuple[str, str]]:
    """The headers that carry `snapshot` to another node, signed with `key` (`peer_client.relay_key`)."""
    value = base64.urlsafe_b64encode(msgspec.json.encode(snapshot)).decode()
    return [(SESSION_HEADER, value), (SESSION_TAG_HEADER, sign(key, value.encode()))]


def session_of(headers: dict[bytes, bytes], key: bytes) -> SessionSnapshot | None:
    """The session a relayed request carries, if `key` signed it; None if it carries none, or a bad one."""
    value = headers.get(SESSION_HEADER.encode())
    tag = headers.get(SESSION_TAG_HEADER.encode())
    if value is None or tag is None:
        return None
    if not hmac.compare_digest(sign(key, value), tag.decode("latin-1")):
        logger.warning("relayed session with a bad tag dropped")
        return None
    try:
        return msgspec.json.decode(base64.urlsafe_b64decode(value), type=SessionSnapshot)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):  # binascii.Error is a ValueError
        logger.warning("relayed session that does not decode dropped")
        return None
