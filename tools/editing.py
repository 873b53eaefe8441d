"""File tools over a sandbox's files, as SWE-agent and mini-swe-agent give them: `view` (numbered lines), `edit`
(replace one exact, unique occurrence) and `create`. The env passes how it reads and writes a file, and what a path is
relative to (it goes into the tools' descriptions, which the model reads):

    view, edit, create = editing_tools(lambda p: sandbox.read(f"repo/{p}"),
                                       lambda p, text: sandbox.write(f"repo/{p}", text), "the repository")
"""

from __future__ import annotations

from typing import Callable

from agentrl.tools.tool import Tool, tool

VIEW_LINES = 200  # what `view` shows when no end is given


def editing_tools(read: Callable[[str], str], write: Callable[[str, str], None], relative_to: str) -> list[Tool]:
    """`view`, `edit` and `create` on the files `read(path)` and `write(path, text)` reach (OSError if they
    cannot); paths are relative to `relative_to`."""

    def view(path: str, start: int = 1, end: int = 0) -> str:
        try:
            lines = read(path).splitlines()
        except OSError as e:
            return f"error: cannot read {path}: {e}"
        end = end if end > 0 else start + VIEW_LINES - 1
        shown = [f"{i:6d}\t{line}" for i, line in enumerate(lines[start - 1:end], start)]
        if not lines:
            return "[empty]"
        return "\n".join(shown) + f"\n[lines {start}-{min(end, len(lines))} of {len(lines)}]"

    def edit(path: str, old: str, new: str) -> str:
        try:
            text = read(path)
        except OSError as e:
            return f"error: cannot read {path}: {e}"
        count = text.count(old)
        if count != 1:
            return f"error: `old` occurs {count} times in {path}; it must occur exactly once"
        write(path, text.replace(old, new))
        return f"edited {path}"

    def create(path: str, content: str) -> str:
        try:
            read(path)
            return f"error: {path} exists; change it with edit"
        except OSError:
            pass
        try:
            write(path, content)
        except OSError as e:
            return f"error: cannot create {path}: {e}"
        return f"created {path}"

    path_doc = f"path: The file, relative to {relative_to}."
    view.__doc__ = f"""Show a file with line numbers.

    Args:
        {path_doc}
        start: First line to show.
        end: Last line to show (0: up to {VIEW_LINES} lines from start).
    """
    edit.__doc__ = f"""Replace one exact occurrence of `old` in a file with `new`.

    Args:
        {path_doc}
        old: Text that occurs exactly once in the file (include enough context to make it unique).
        new: The replacement.
    """
    create.__doc__ = f"""Create a new file.

    Args:
        {path_doc}
        content: Its content.
    """
    return [tool(timeout=30.0)(view), tool(timeout=30.0)(edit), tool(timeout=30.0)(create)]
