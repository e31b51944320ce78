"""PII and toxicity filters measured on hand-written real-world text, not on their own generators.

The fixtures below were written by hand, without the filters' regexes or word lists in view: PII
as people actually type it (spaces, dashes, brackets, country codes, full-width digits,
sub-addressed emails, "name at domain dot com") and look-alikes that are not PII; abusive text
phrased the way people write it and clean text that comes close. Each test measures recall and
precision through the pipeline (``normalize`` first, as in the default order) and holds the
filter to exactly what docs/data.md says it catches: the figures there and the misses it lists,
so a regression fails, and so does an improvement until the docs say it.
"""

from __future__ import annotations

import re
from pathlib import Path

from workbench.data.clean import clean_records

DOCS = Path(__file__).resolve().parents[2] / "docs" / "data.md"

_PLACEHOLDER = re.compile(r"<[A-Z_]+>")  # what the scrubber writes in place of a value

# (text, the PII value that must be gone from it)
PII = [
    ("Write to maria.gonzalez+invoices@mail.example.co.uk about the bill.",
     "maria.gonzalez+invoices@mail.example.co.uk"),
    ("Contact: J.Smith@Research.Uni-Example.EDU (office hours Tue).", "J.Smith@Research.Uni-Example.EDU"),
    ("ping me at first_last@sub.domain.io!", "first_last@sub.domain.io"),
    ("mail me: kim dot lee at gmail dot com", "kim dot lee at gmail dot com"),
    ("reach bob at example dot org for the keys", "bob at example dot org"),
    ("Call +1 (415) 555-0132 after six.", "555-0132"),
    ("Office: +44 20 7946 0958, ask for Sam.", "7946 0958"),
    ("Tel. (212) 555-0187", "555-0187"),
    ("my cell is 415.555.0199", "415.555.0199"),
    ("电话：+86 138 0013 8000，下午打。", "138 0013 8000"),
    ("手机 139-1234-5678 联系王先生", "139-1234-5678"),
    ("手机号：１３８１２３４５６７８", "１３８１２３４５６７８"),
    ("座机 010-62345678 转 123", "62345678"),
    ("Phone: +49 (0)30 901820", "901820"),
    ("SSN 078-05-1120 on the form", "078-05-1120"),
    ("身份证号 11010519491231002X 已核对", "11010519491231002X"),
    ("身份证：110105 19491231 002X", "19491231"),
    ("Card 4111 1111 1111 1111 exp 12/27", "4111 1111 1111 1111"),
    ("paid with 5500-0000-0000-0004", "5500-0000-0000-0004"),
    ("server at 192.168.10.24 is down", "192.168.10.24"),
    ("IPv6 2001:db8:85a3::8a2e:370:7334 answers", "2001:db8:85a3::8a2e:370:7334"),
]

# Text with numbers, at-signs and dots that is not PII: nothing in it may be replaced.
NOT_PII = [
    "Version 3.10.12 fixed the bug reported on 2024-05-17 at 09:30.",
    "Order #20240517001234 shipped; total $1,299.00 incl. tax.",
    "ISBN 978-0-13-468599-1 is the second edition.",
    "Meet @alice and @bob in room 4.12 at 3 pm.",
    "The ratio was 1:2:3 and the score 98.6 out of 100.",
    "Coordinates 37.7749, -122.4194 mark the city.",
    "Population grew from 1,400,000 to 1,412,000 in 2023.",
    "Use numpy>=1.26,<2 and python 3.11.",
    "第3章第12节，共240页，定价48.00元。",
    "在2023年12月31日前提交，编号A-2023-0042。",
    "We met at the station at noon.",
    "The package is at pypi dot org, search for it there.",
    "Flight CA1234 leaves gate 12 at 08:45.",
    "Batch size 32, lr 3e-4, 1000 steps, seed 42.",
]

# Abusive or hateful text, phrased as people write it (not lifted from any word list).
TOXIC = [
    "You are a worthless piece of shit and everyone knows it.",
    "Shut the fuck up, nobody asked you.",
    "What a dumbass, go kill yourself.",
    "fuck off and die, loser",
    "This bitch never pays back anything.",
    "Stop being such a retard about it.",
    "He's a lying bastard and a coward.",
    "你他妈的是不是有病？",
    "滚蛋，你这个傻逼。",
    "What an asshole move, seriously.",
    "f*ck this place and everyone in it",
    "You stupid c u n t.",
]

# Clean text that comes close: the same topics, or innocent words that contain bad substrings.
CLEAN = [
    "The assessment of the class was fair and thorough.",
    "Scunthorpe United won the match on Saturday.",
    "She studied the cockpit layout before the flight.",
    "Dick Van Dyke starred in the film.",
    "Please analyse the shiitake mushroom harvest.",
    "The hotel in Middlesex has a spa.",
    "Kill the process with SIGTERM, then restart it.",
    "The documentary covered hate speech laws in Europe.",
    "Mind the gap between the train and the platform.",
    "He passed the bass guitar to his sister.",
    "我们明天去公园散步吧。",
    "This function is dead simple to call.",
]


def _pii_scores() -> tuple[float, float, list[str], list[str]]:
    texts = [t for t, _ in PII] + NOT_PII
    rows, _ = clean_records([{"text": t} for t in texts], steps=["normalize", "pii"], workers=1,
                            progress=False)
    out = [r["text"] for r in rows]
    missed = [t for (t, value), o in zip(PII, out) if value in o or not _PLACEHOLDER.search(o)]
    false = [t for t, o in zip(NOT_PII, out[len(PII):]) if _PLACEHOLDER.search(o)]
    caught = len(PII) - len(missed)
    recall = caught / len(PII)
    precision = caught / (caught + len(false)) if caught + len(false) else 1.0
    return recall, precision, missed, false


def _toxicity_scores() -> tuple[float, float, list[str], list[str]]:
    texts = TOXIC + CLEAN
    rows, _ = clean_records([{"i": i, "text": t} for i, t in enumerate(texts)],
                            steps=["normalize", "toxicity"], workers=1, progress=False)
    kept = {r["i"] for r in rows}
    missed = [t for i, t in enumerate(TOXIC) if i in kept]
    false = [t for i, t in enumerate(CLEAN, start=len(TOXIC)) if i not in kept]
    caught = len(TOXIC) - len(missed)
    recall = caught / len(TOXIC)
    precision = caught / (caught + len(false)) if caught + len(false) else 1.0
    return recall, precision, missed, false


def _documented(figure: str, texts: list[str]) -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert figure in text, f"docs/data.md does not say {figure!r}"
    for t in texts:
        assert f"`{t}`" in text, f"docs/data.md does not list {t!r}"


def test_pii_recall_and_precision_on_hand_written_text() -> None:
    recall, precision, missed, false = _pii_scores()
    print(f"\nPII: recall {recall:.2f} ({len(PII) - len(missed)}/{len(PII)}), "
          f"precision {precision:.2f}; missed: {missed}; false positives: {false}")
    assert missed == KNOWN_MISSES["pii"]
    assert false == KNOWN_FALSE["pii"]
    _documented(f"catches **{len(PII) - len(missed)} of {len(PII)}**", missed + false)


def test_toxicity_recall_and_precision_on_hand_written_text() -> None:
    recall, precision, missed, false = _toxicity_scores()
    print(f"\ntoxicity: recall {recall:.2f} ({len(TOXIC) - len(missed)}/{len(TOXIC)}), "
          f"precision {precision:.2f}; missed: {missed}; false positives: {false}")
    assert missed == KNOWN_MISSES["toxicity"]
    assert false == KNOWN_FALSE["toxicity"]
    _documented(f"removes **{len(TOXIC) - len(missed)} of {len(TOXIC)}**", missed)


# What the filters miss, and take that is clean, on the fixtures above: as docs/data.md lists
# them. PII misses the spelled-out emails ("x at y dot com"), full-width digits (normalize does
# not fold them), a German number with a "(0)" trunk prefix and a resident ID written in groups;
# it takes a 14-digit order number that happens to pass Luhn for a card. Toxicity misses
# "dumbass" / "kill yourself" and masked spellings ("f*ck", "c u n t").
KNOWN_MISSES = {
    "pii": ["mail me: kim dot lee at gmail dot com", "reach bob at example dot org for the keys",
            "手机号：１３８１２３４５６７８", "Phone: +49 (0)30 901820",
            "身份证：110105 19491231 002X"],
    "toxicity": ["What a dumbass, go kill yourself.", "f*ck this place and everyone in it",
                 "You stupid c u n t."],
}
KNOWN_FALSE = {
    "pii": ["Order #20240517001234 shipped; total $1,299.00 incl. tax."],
    "toxicity": [],
}
