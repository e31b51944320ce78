"""What changed between two texts, for people to see: the window around the first change, and
the words that differ marked in HTML (``<del>`` on the side they left, ``<ins>`` on the side they
came to). The cleaning report uses it for a rewrite's before and after (PII, normalize) and for a
near-duplicate next to the document it duplicates.

    >>> window("call 555-0100 now", "call <PHONE> now")
    ('call 555-0100 now', 'call <PHONE> now')
    >>> before, after = marked("a b c", "a x c")
    >>> before.replace(_DEL, ""), after.replace(_INS, "")
    ('a <del >b</del> c', 'a <ins >x</ins> c')
"""

from __future__ import annotations

import difflib
import html
import re

SCAN_CHARS = 20_000  # texts are compared over this many characters at most (a report, not a diff)
_WORDS = re.compile(r"\S+|\s+")
_DEL = "style='background:#ffd7d5;text-decoration:line-through'"
_INS = "style='background:#ccffd8;text-decoration:none'"


def window(before: str, after: str, width: int = 300) -> tuple[str, str]:
    """Both texts cut to ``width`` characters around their first difference (with … where cut)."""
    a, b = before[:SCAN_CHARS], after[:SCAN_CHARS]
    start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, start - width // 3)

    def cut(text: str) -> str:
        part = text[lo:lo + width]
        return ("…" if lo else "") + part + ("…" if lo + width < len(text) else "")

    return cut(before), cut(after)


def marked(before: str, after: str) -> tuple[str, str]:
    """(before, after) as HTML with the words that differ marked; everything else escaped."""
    a, b = _WORDS.findall(before[:SCAN_CHARS]), _WORDS.findall(after[:SCAN_CHARS])
    left, right = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        old, new = html.escape("".join(a[i1:i2])), html.escape("".join(b[j1:j2]))
        if op == "equal":
            left.append(old)
            right.append(new)
            continue
        if old:
            left.append(f"<del {_DEL}>{old}</del>")
        if new:
            right.append(f"<ins {_INS}>{new}</ins>")
    return "".join(left), "".join(right)
