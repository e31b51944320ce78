"""The run form's look at image rows: each row's pictures as thumbnails beside its question and
answer, in one HTML table (the text rows' preview is :func:`workbench.widgets.run_form`'s).

A thumbnail is the image itself scaled down to at most :data:`THUMB` pixels a side, inlined as
a PNG ``data:`` URL, so the preview shows in any front end without serving files.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

THUMB = 64  # pixels, the longer side of a thumbnail
TEXT = 120  # characters of a question or answer shown


def thumbnail_url(image: str | bytes) -> str:
    """A normalised image (a path or its bytes) as a small PNG ``data:`` URL."""
    from workbench.data.images import open_image

    with open_image(image) as img:
        small = img.convert("RGB")
        small.thumbnail((THUMB, THUMB))
        buf = io.BytesIO()
        small.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _text(content: Any) -> str:
    """A turn's text: a string, or the text parts of a content list joined."""
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if p.get("type") == "text")


def image_rows_html(examples: list[dict[str, Any]]) -> str:
    """Image rows (``{"messages": [...]}`` with image parts, as workbench.data.images makes
    them) as a table: pictures, the first question, the first answer."""
    out = ["<table style='font-size:12px'><tr><th>image</th><th>prompt</th>"
           "<th>response</th></tr>"]
    for ex in examples:
        turns = ex["messages"]
        images = [p["image"] for t in turns if not isinstance(t["content"], str)
                  for p in t["content"] if p.get("type") == "image"]
        pics = "".join(f"<img src='{thumbnail_url(i)}' style='margin-right:2px'>" for i in images)
        ask = next((_text(t["content"]) for t in turns if t["role"] == "user"), "")
        answer = next((_text(t["content"]) for t in turns if t["role"] == "assistant"), "")
        out.append(f"<tr><td>{pics}</td>"
                   f"<td style='text-align:left'>{html.escape(ask[:TEXT])}</td>"
                   f"<td style='text-align:left'>{html.escape(answer[:TEXT])}</td></tr>")
    return "".join(out) + "</table>"
