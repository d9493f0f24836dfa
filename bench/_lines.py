"""The child's side of a bench's request loop: JSON lines over stdin and stdout.

A bench's baseline and its SDK client each run in a process of their own. Once loaded, the
child prints "ready"; then each line it reads is a request {"op": NAME, ...arguments}, which
it answers with one JSON line, the result of `handlers[NAME](**arguments)`. End of input ends
it. The parent's side is `_daemon.Child`. Standard library only: baselines import this, and
nothing of openrld may come with it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping


def serve(handlers: Mapping[str, Callable[..., object]]) -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        print(json.dumps(handlers[op](**request)), flush=True)
