"""Stored text as the commands print it: never a character a terminal acts on.

Tenants, operation names and keys reach the records from clients (a tenant
read from a header, a name from a path, rows written before names were
checked), and the commands print them to an operator's terminal and to the
logs a probe keeps. ESC starts a control sequence (clear the screen, set
the window's title), CR returns to the line's start so that what follows
overwrites it, LF starts a line of the text's own ("status: healthy"), a
tab forges a column of a tab-separated listing, and a bidirectional
override reorders what the operator reads. Each such character is
written as its Python escape instead (``\\x1b``, ``\\r``, ``\\u202e``);
everything printable is left as it is, so ordinary names read unchanged.
"""

from __future__ import annotations

__all__ = ["printable"]

_SHORT_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def printable(text: str) -> str:
    """``text`` with every unprintable character written as its escape."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def _escape(char: str) -> str:
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
