"""PII scrubbing: replace emails, phone numbers (including Chinese mobiles), IP addresses,
national ID numbers (Chinese resident ID, US SSN) and payment card numbers with placeholders.

Number patterns are checked beyond the regex where a checksum exists (the resident ID's
ISO 7064 MOD 11-2 check character, the Luhn digit of card numbers), so ordinary long numbers such
as order ids are left alone. Each kind runs in a fixed order and replaced spans become
placeholders, so one span is never counted twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from workbench.data.clean.step import Doc, Step, check

_EMAIL = re.compile(r"(?<![A-Za-z0-9_.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@"
                    r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z0-9_-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)")
_H = r"[0-9A-Fa-f]{1,4}"
_IPV6 = re.compile(rf"(?<![A-Za-z0-9_:])(?:(?:{_H}:){{7}}{_H}"
                   rf"|(?:{_H}:){{1,6}}:(?:{_H}:){{0,5}}{_H})(?![A-Za-z0-9_:])")
# Chinese resident identity card (GB 11643-1999): region, birth date YYYYMMDD, sequence, check.
_CN_ID = re.compile(r"(?<![\dA-Za-z])[1-9]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])"
                    r"(?:0[1-9]|[12]\d|3[01])\d{3}[\dXx](?![\dA-Za-z])")
# 13-19 digit card numbers, optionally grouped by single spaces or dashes.
_CARD = re.compile(r"(?<![\d+-])\d(?:[ -]?\d){12,18}(?![\d-])")
_SSN = re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])")
# Chinese mobile numbers (MIIT plan: 1[3-9]x), optional +86 / 0086, optional 3-4-4 grouping.
_CN_MOBILE = re.compile(r"(?<![\d+])(?:(?:\+|00)86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")
# Other phone numbers: international (+CC ...), North American (xxx) xxx-xxxx, Chinese landlines
# 0xx(x)-xxxxxxx(x). Separators are required so that bare numbers are not taken for phones.
_PHONE = re.compile(
    r"(?<![A-Za-z0-9_+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]\d{2,4}){1,4}"
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"
    r"|\d{3}[.-]\d{3}[.-]\d{4}"
    r"|0\d{2,3}-\d{7,8}"
    r")(?!\d)"
)

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def cn_id_checksum_ok(number: str) -> bool:
    """True when an 18-character Chinese resident ID has a valid check character."""
    total = sum(int(d) * w for d, w in zip(number[:17], _ID_WEIGHTS, strict=True))
    return "10X98765432"[total % 11] == number[17].upper()


def luhn_ok(digits: str) -> bool:
    """True when the digit string passes the Luhn check used by payment card numbers."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_ok(span: str) -> bool:
    digits = span.replace(" ", "").replace("-", "")
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


# (kind, pattern, extra check on the matched text) in the order they are applied.
PII_KINDS: list[tuple[str, re.Pattern[str], Callable[[str], bool] | None]] = [
    ("email", _EMAIL, None),
    ("ip_address", _IPV4, None),
    ("ip_address", _IPV6, None),
    ("id_number", _CN_ID, cn_id_checksum_ok),
    ("phone", _CN_MOBILE, None),
    ("card_number", _CARD, _card_ok),
    ("id_number", _SSN, None),
    ("phone", _PHONE, None),
]
KNOWN_KINDS = ("email", "phone", "ip_address", "id_number", "card_number")

_DIGIT = re.compile(r"\d")
# Necessary conditions for a pattern to match anywhere in a text, given the text and its number
# of ``\d`` digits: the fewest digits any match contains (an IPv4 address has 4, a Chinese ID
# 17, a card number 13, ...) and a character every match needs. Most documents have no '@' and
# few digits, so most of the expensive scans are skipped; a skipped scan could not have matched,
# so the output is the same as running every pattern.
_GATES: dict[re.Pattern[str], Callable[[str, int], bool]] = {
    _EMAIL: lambda text, digits: "@" in text,
    _IPV4: lambda text, digits: digits >= 4 and "." in text,
    _IPV6: lambda text, digits: "::" in text or text.count(":") >= 7,
    _CN_ID: lambda text, digits: digits >= 17,
    _CN_MOBILE: lambda text, digits: digits >= 11,
    _CARD: lambda text, digits: digits >= 13,
    _SSN: lambda text, digits: digits >= 9 and "-" in text,
    _PHONE: lambda text, digits: digits >= 4,
}


def _default_replacements() -> dict[str, str]:
    return {k: f"<{k.upper()}>" for k in KNOWN_KINDS}


@dataclass
class PIIScrubber(Step):
    """Replace PII in every text field with placeholders (rewrites text, never removes).

    Defaults: all of ``kinds`` (email, phone, ip_address, id_number, card_number), replaced by
    ``<EMAIL>``, ``<PHONE>``, ``<IP_ADDRESS>``, ``<ID_NUMBER>``, ``<CARD_NUMBER>``. Emails and IP
    addresses are what FineWeb's PII formatter anonymises; phones, ID and card numbers follow
    BigScience ROOTS / StarCoder PII practice, with Chinese mobiles (1[3-9]x xxxx xxxx, optional
    +86) and resident IDs (GB 11643, checksum verified) added for Chinese data.

    >>> PIIScrubber().scrub("mail me: li.wei@example.cn, 13812345678")[0]
    'mail me: <EMAIL>, <PHONE>'
    """

    name: ClassVar[str] = "pii"
    rewrites: ClassVar[bool] = True

    kinds: list[str] = field(default_factory=lambda: list(KNOWN_KINDS))
    replacements: dict[str, str] = field(default_factory=_default_replacements)

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KNOWN_KINDS]
        check(not unknown, f"unknown PII kind(s) {unknown}; known: {', '.join(KNOWN_KINDS)}")
        self.replacements = {**_default_replacements(), **self.replacements}

    def scrub(self, text: str) -> tuple[str, dict[str, int]]:
        """``text`` with PII replaced, and how many spans of each kind were replaced."""
        counts: dict[str, int] = {}
        digits = len(_DIGIT.findall(text))
        replaced = 0
        for kind, pattern, valid in PII_KINDS:
            if kind not in self.kinds or not _GATES[pattern](text, digits):
                continue
            repl = self.replacements[kind]

            def sub(m: re.Match[str], kind: str = kind, repl: str = repl,
                    valid: Callable[[str], bool] | None = valid) -> str:
                if valid is not None and not valid(m.group(0)):
                    return m.group(0)
                counts[kind] = counts.get(kind, 0) + 1
                return repl

            text = pattern.sub(sub, text)
            if sum(counts.values()) != replaced:  # the text changed: count its digits again
                replaced = sum(counts.values())
                digits = len(_DIGIT.findall(text))
        return text, counts

    def apply(self, doc: Doc) -> str | None:
        new = {}
        changed = False
        for name, value in doc.texts.items():
            scrubbed, counts = self.scrub(value)
            new[name] = scrubbed
            for kind, n in counts.items():
                doc.counters[kind] = doc.counters.get(kind, 0) + n
                changed = True
        if changed:
            doc.set_texts(new)
        return None
