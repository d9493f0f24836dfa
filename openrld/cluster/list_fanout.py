"""List routes on a clustered node: every live member's page of runs or checkpoints, merged into one.

A client lists through any node and sees the runs and checkpoints of every
node it may see. The node that got the request asks each live member (itself
through its own app) for the first `offset + limit` items, keeps the first
copy of each item (a run or checkpoint a node adopted from a shared root is
listed by two), orders them newest first by their time, and answers the page.
A member that fails with a 5xx is left out of the page; a 4xx (a bad key, a
bad query) is the answer. Times are compared as times, not as strings: two
nodes may write the same instant differently (`Z` or `+00:00`, with or without
a fraction).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import msgspec
import trio

from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.cluster.membership.table import Member


class FanOut(msgspec.Struct, frozen=True):
    """How one list route's pages merge (declared with the route, in `api/routes.py`)."""

    key: str  # the list's key in the page
    order_by: str  # the item field it is ordered by, newest first
    default_limit: int  # the page size when the query names none


_OLDEST = datetime.min.replace(tzinfo=UTC)  # where an item without a readable time sorts


class PageQuery(msgspec.Struct, frozen=True):
    limit: int
    offset: int
    member_query: bytes  # what each member is asked: the same query, from 0 to offset + limit


def page_query(query_string: bytes, default_limit: int) -> PageQuery | Reply:
    """The page a list request asks for, or the 400 that says what is wrong with it."""
    query = dict(pair.split("=", 1) for pair in query_string.decode().split("&") if "=" in pair)
    try:
        limit = int(query.get("limit", str(default_limit)))
        offset = int(query.get("offset", "0"))
    except ValueError:
        return detail_reply(400, "limit and offset must be integers")
    if limit < 1 or offset < 0:
        return detail_reply(400, f"limit must be >= 1 and offset >= 0, got limit={limit} offset={offset}")
    member_query = "&".join(f"{k}={v}" for k, v in {**query, "limit": str(offset + limit), "offset": "0"}.items())
    return PageQuery(limit, offset, member_query.encode())


def item_time(value: Any) -> datetime:
    """An item's RFC 3339 / ISO 8601 time as an aware datetime; an unreadable or missing one is the oldest."""
    if not isinstance(value, str):
        return _OLDEST
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return _OLDEST
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def merge_pages(pages: Iterable[Reply], key: str, order_by: str, page: PageQuery) -> Reply:
    """One page from the members' pages: see the module docstring."""
    items: dict[str, dict] = {}
    total = 0
    for answer in pages:
        if answer.status != 200:
            if answer.status < 500:
                return answer
            continue  # a member that cannot answer now is left out of the page
        body = msgspec.json.decode(answer.body)
        total += body["cursor"]["total_count"]
        for item in body[key]:
            items.setdefault(item.get("training_run_id") or item.get("tinker_path"), item)
    merged = sorted(items.values(), key=lambda item: item_time(item.get(order_by)), reverse=True)
    cursor = {"offset": page.offset, "limit": page.limit, "total_count": total}
    return json_reply({key: merged[page.offset : page.offset + page.limit], "cursor": cursor})


async def fan_out(
    scope: dict, spec: FanOut, members: Iterable[Member], ask: Callable[[Member, dict], Awaitable[Reply]]
) -> Reply:
    """The list `scope` asks for, merged by `spec` from every live member; `ask(member, scope)` gets one's page."""
    page = page_query(scope.get("query_string", b""), spec.default_limit)
    if isinstance(page, Reply):
        return page
    member_scope = {**scope, "query_string": page.member_query}
    pages: list[Reply] = []

    async def one(member: Member) -> None:
        pages.append(await ask(member, member_scope))

    async with trio.open_nursery() as nursery:
        for member in members:
            if member.is_alive:
                nursery.start_soon(one, member)
    return merge_pages(pages, spec.key, spec.order_by, page)
