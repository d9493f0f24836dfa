"""The model's tools: list files, read a file or a line range, search, write a file, finish.

Each tool is a cookbook `@tool` method, so its JSON schema reaches the model
through the renderer's tool-call format and its arguments are validated before it
runs. Every action is one command in the episode's `Sandbox`: the tools choose the
command, the sandbox decides what it can reach. Relative paths name files in the
workspace (cwd) for reading, and in the scratch directory for writing, where the
deliverable goes. A failed command comes back to the model as an error message; no
tool raises.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from tinker_cookbook.tool_use import ToolResult, simple_tool_result, tool

from recipes.agentic.sandbox import SCRATCH, CommandResult, Sandbox

NO_MATCHES = "no matches"


def _scratch_path(path: str) -> str:
    return path if path.startswith("/") else f"{SCRATCH}/{path}"


def _shown(result: CommandResult, *, empty: str = "") -> str:
    """What the model sees of a command: its output, or why it failed."""
    if result.timed_out:
        return "error: the command ran out of time"
    if result.exit_code == 0:
        text = result.stdout
    else:
        text = f"error: {result.stderr.strip() or f'exit code {result.exit_code}'}"
    if result.truncated:
        text += "\n[output truncated]"
    return text or empty


class WorkspaceTools:
    """The five tools over one sandbox. `finished` turns True once the model calls finish."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.finished = False

    async def _run(self, argv: list[str], stdin: bytes = b"") -> CommandResult:
        # A thread: the command blocks for its duration, and other episodes sample meanwhile.
        return await asyncio.to_thread(self.sandbox.run, argv, stdin)

    def all(self) -> list:
        return [self.list_files, self.read_file, self.search, self.write_file, self.finish]

    @tool
    async def list_files(self) -> ToolResult:
        """List the workspace's documents and the files written so far (under /scratch)."""
        listing = "find . -type f -printf '%P\\n' | sort; find /scratch -type f | sort"
        return simple_tool_result(_shown(await self._run(["sh", "-c", listing]), empty="(no files)"))

    @tool
    async def read_file(
        self,
        path: Annotated[str, "The file, relative to the workspace"],
        start_line: Annotated[int, "First line to show (1-based)"] = 1,
        end_line: Annotated[int, "Last line to show; 0 for the end of the file"] = 0,
    ) -> ToolResult:
        """Read a file, or the lines start_line..end_line of it."""
        last = "$" if end_line <= 0 else str(end_line)
        result = await self._run(["sed", "-n", f"{max(start_line, 1)},{last}p", "--", path])
        return simple_tool_result(_shown(result, empty="(empty)"))

    @tool
    async def search(
        self,
        text: Annotated[str, "The text to look for (plain text, not a pattern)"],
        path: Annotated[str, "A file or directory, relative to the workspace"] = ".",
    ) -> ToolResult:
        """Find the lines that contain a text, with their file and line number."""
        # With no path operand, grep -r searches "." and names files without the "./".
        where = [] if path in (".", "./", "") else ["--", path]
        result = await self._run(["grep", "-rnF", "-e", text, *where])
        if result.exit_code == 1 and not result.stderr:  # grep's "nothing found"
            return simple_tool_result(NO_MATCHES)
        return simple_tool_result(_shown(result))

    @tool
    async def write_file(
        self,
        path: Annotated[str, "The file to write, relative to the scratch directory"],
        content: Annotated[str, "The whole content of the file"],
    ) -> ToolResult:
        """Write a file in the scratch directory, replacing it if it exists."""
        target = _scratch_path(path)
        command = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = await self._run(["sh", "-c", command, "sh", target], stdin=content.encode())
        return simple_tool_result(_shown(result) or f"wrote {len(content.encode())} bytes to {target}")

    @tool
    async def finish(self) -> ToolResult:
        """Say the deliverable is written; ends the episode."""
        self.finished = True
        return simple_tool_result("finished", should_stop=True)


def read_deliverable(sandbox: Sandbox, path: str) -> str | None:
    """The deliverable's text as the sandbox sees it, or None when it was never written."""
    result = sandbox.run(["cat", "--", _scratch_path(path)])
    return result.stdout if result.exit_code == 0 and not result.timed_out else None
