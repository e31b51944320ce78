"""A deterministic mixed Chinese/English corpus with planted problems, for tests, the benchmark
and the data notebook.

Every record says what it is (``kind``) and, for planted duplicates, which document it copies
(``source``), so a cleaning run can be scored: exact duplicates (some differing only in
whitespace), near duplicates (about 1% of words changed, plus a sentence), documents with PII
(the values are listed in ``pii``), toxic documents, low-quality ones (spam lines, bullet lists,
symbol runs, lorem ipsum, fragments) and a few in other languages. Generation streams, so
:func:`write_corpus` can produce a 1 GB file in constant memory.

    >>> rows = list(generate_records(50, seed=1))
    >>> len(rows), rows[0]["kind"] in KINDS
    (50, True)
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.data.clean.toxicity import BUNDLED_WORDLISTS, load_wordlist

KINDS = ("en", "zh", "exact_dup", "near_dup", "pii", "toxic", "junk", "other_lang")

_EN = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education river garden market winter summer village
train bridge kitchen letter window music picture weather island forest mountain language farmer
doctor engine museum library station journey morning evening report season project harvest
good new first last long great little own other old right big high different small large next
early young important few public bad same able open quiet simple careful bright heavy warm
make know take see come think look want give use find tell ask work seem feel try leave call
build carry walk open begin write read learn change follow stop create speak allow spend grow
offer remember consider appear buy wait serve send expect stay fall reach raise pass sell
decide explain develop return describe prepare improve measure visit share collect repair""".split()  # noqa: SIM905 (a word list reads best as text)
_EN_STOP = """the the the of of and and to to a a in in that is was for with on as it be have
by""".split()  # noqa: SIM905
_ZH = """我们 他们 今天 明天 时间 学校 老师 学生 朋友 工作 公司 城市 国家 问题 方法 结果 研究 发展
经济 社会 文化 历史 科学 技术 数据 模型 语言 文字 天气 季节 春天 夏天 秋天 冬天 山区 河流 森林
农民 工厂 市场 银行 医院 医生 病人 家庭 父母 孩子 早上 晚上 中午 周末 假期 旅行 火车 飞机 道路
桥梁 图书馆 博物馆 音乐 电影 新闻 报告 会议 计划 项目 目标 经验 能力 机会 环境 空气 水平 质量
安全 健康 教育 生活 重要 简单 复杂 认真 仔细 安静 热闹 美丽 干净 方便 快速 缓慢 明显 主要 基本
学习 研究 讨论 分析 解决 参加 准备 开始 结束 继续 发现 介绍 说明 提高 改善 建设 保护 管理 使用
选择 决定 希望 觉得 认为 知道 需要 喜欢 帮助 支持 组织 完成 检查 记录 收集 修理 参观 分享""".split()  # noqa: SIM905 (a word list reads best as text)
_ZH_STOP = list("的的的了了是是在在和有也就都这")
_FR = """le la les un une des et est dans pour avec sur nous vous ils elles avoir faire aller voir
maison ville temps jour année travail enfant école pays monde eau soleil chemin marché jardin
toujours souvent jamais aussi très bien petit grand nouveau vieux heureux beaucoup""".split()  # noqa: SIM905 (a word list reads best as text)
_LOREM = """lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod
tempor""".split()  # noqa: SIM905


def _luhn_complete(prefix: str) -> str:
    """``prefix`` plus the digit that makes it pass the Luhn check."""
    for d in "0123456789":
        digits = prefix + d
        total = sum(int(c) if i % 2 == 0 else (int(c) * 2 - 9 if int(c) > 4 else int(c) * 2)
                    for i, c in enumerate(reversed(digits)))
        if total % 10 == 0:
            return digits
    raise AssertionError("unreachable")


def _cn_id(rng: random.Random) -> str:
    body = (f"{rng.randint(110000, 659000)}{rng.randint(1950, 2005)}{rng.randint(1, 12):02d}"
            f"{rng.randint(1, 28):02d}{rng.randint(0, 999):03d}")
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    return body + "10X98765432"[sum(int(d) * w for d, w in zip(body, weights, strict=True)) % 11]


def pii_samples(rng: random.Random) -> dict[str, str]:
    """One value of every PII form the pii step scrubs, keyed by form."""
    card = _luhn_complete("4" + "".join(rng.choice("0123456789") for _ in range(14)))
    return {
        "email": f"user{rng.randint(1, 99999)}.{rng.choice(['li', 'wang', 'smith'])}@example.com",
        "cn_mobile": f"1{rng.choice('3456789')}{rng.randint(0, 999999999):09d}",
        "cn_mobile_intl": f"+86 13{rng.randint(0, 9)}-{rng.randint(1000, 9999)}-"
                          f"{rng.randint(1000, 9999)}",
        "phone_us": f"({rng.randint(201, 989)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
        "phone_intl": f"+44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}",
        "phone_cn_landline": f"010-{rng.randint(10000000, 99999999)}",
        "ipv4": f"{rng.randint(11, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}."
                f"{rng.randint(1, 254)}",
        "ipv6": ":".join(f"{rng.randint(0, 65535):x}" for _ in range(8)),
        "cn_id": _cn_id(rng),
        "ssn": f"{rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}",
        "card": " ".join(card[i:i + 4] for i in range(0, 16, 4)),
        "card_plain": _luhn_complete("5" + "".join(rng.choice("0123456789") for _ in range(14))),
    }


class _Writer:
    def __init__(self, seed: int, zh_fraction: float, doc_chars: tuple[int, int]) -> None:
        self.rng = random.Random(seed)
        self.zh_fraction = zh_fraction
        self.doc_chars = doc_chars
        en = load_wordlist(BUNDLED_WORDLISTS / "en.txt")
        self.toxic = {"en": [w for w in en if " " not in w],
                      "zh": load_wordlist(BUNDLED_WORDLISTS / "zh.txt")}

    def _sentence(self, lang: str) -> list[str]:
        rng = self.rng
        if lang == "zh":
            return [rng.choice(_ZH_STOP) if rng.random() < 0.2 else rng.choice(_ZH)
                    for _ in range(rng.randint(6, 14))]
        vocab = _FR if lang == "fr" else _EN
        return [rng.choice(_EN_STOP) if lang == "en" and rng.random() < 0.3 else rng.choice(vocab)
                for _ in range(rng.randint(8, 18))]

    def words(self, lang: str) -> list[list[list[str]]]:
        """Paragraphs of sentences of words, about ``doc_chars`` long."""
        target = self.rng.randint(*self.doc_chars)
        per_char = 2.2 if lang == "zh" else 6.5  # rough characters per word, incl. spaces
        paragraphs: list[list[list[str]]] = []
        n = 0.0
        while n < target:
            para = [self._sentence(lang) for _ in range(self.rng.randint(2, 5))]
            n += sum(len(s) for s in para) * per_char
            paragraphs.append(para)
        return paragraphs

    @staticmethod
    def render(lang: str, paragraphs: list[list[list[str]]]) -> str:
        if lang == "zh":
            return "\n\n".join("".join("".join(s) + "。" for s in p) for p in paragraphs)
        return "\n\n".join(" ".join(" ".join(s).capitalize() + "." for s in p)
                           for p in paragraphs)

    def near_copy(self, lang: str, paragraphs: list[list[list[str]]]) -> str:
        vocab = _ZH if lang == "zh" else _EN
        changed = [[[self.rng.choice(vocab) if self.rng.random() < 0.01 else w for w in s]
                    for s in p] for p in paragraphs]
        changed[-1] = changed[-1] + [self._sentence(lang)[:6]]
        return self.render(lang, changed)

    def junk(self) -> str:
        rng = self.rng
        tag = f"{rng.choice(_EN)}{rng.randint(0, 10**9)}"
        style = rng.randrange(5)
        if style == 0:
            return "\n".join([f"Click here to buy now {tag}!"] * rng.randint(8, 20))
        if style == 1:
            return "\n".join(f"- {rng.choice(_EN)} {rng.choice(_EN)}" for _ in range(30)) + tag
        if style == 2:
            return " ".join(f"### {rng.choice(_EN)} ..." for _ in range(40)) + tag
        if style == 3:
            return (" ".join(rng.choice(_LOREM) for _ in range(120)) + ". " + tag).capitalize()
        return f"ok {tag}"


def generate_records(n_docs: int | None = 1000, seed: int = 0, *, zh_fraction: float = 0.4,
                     exact_dup_fraction: float = 0.08, near_dup_fraction: float = 0.08,
                     pii_fraction: float = 0.05, toxic_fraction: float = 0.03,
                     junk_fraction: float = 0.05, other_lang_fraction: float = 0.02,
                     doc_chars: tuple[int, int] = (400, 2000)) -> Iterator[dict[str, Any]]:
    """Yield ``n_docs`` records (forever when None): ``{"id", "text", "kind", "source", "pii"}``.

    ``source`` is the id of the document a duplicate copies (``None`` otherwise); ``pii`` lists
    the PII values planted in the text. Duplicates copy one of the last 1,000 clean documents.
    """
    w = _Writer(seed, zh_fraction, doc_chars)
    rng = w.rng
    pool: deque[tuple[str, str, list, str]] = deque(maxlen=1000)  # (id, lang, words, text)
    cut = [exact_dup_fraction, near_dup_fraction, pii_fraction, toxic_fraction, junk_fraction,
           other_lang_fraction]
    i = 0
    while n_docs is None or i < n_docs:
        doc_id = f"doc-{i:07d}"
        r = rng.random()
        kind = "clean"
        names = ("exact_dup", "near_dup", "pii", "toxic", "junk", "other_lang")
        for name, frac in zip(names, cut, strict=True):
            if r < frac:
                kind = name
                break
            r -= frac
        if kind in ("exact_dup", "near_dup") and not pool:
            kind = "clean"
        row: dict[str, Any] = {"id": doc_id, "source": None, "pii": []}
        lang = "zh" if rng.random() < zh_fraction else "en"
        if kind == "exact_dup":
            src_id, lang, _, text = rng.choice(pool)
            # Half differ only in whitespace, which normalisation removes.
            row.update(kind=kind, source=src_id,
                       text=text if rng.random() < 0.5 else "  " + text.replace(" ", "  ") + "\n")
        elif kind == "near_dup":
            src_id, lang, paragraphs, _ = rng.choice(pool)
            row.update(kind=kind, source=src_id, text=w.near_copy(lang, paragraphs))
        elif kind == "junk":
            row.update(kind=kind, text=w.junk())
        elif kind == "other_lang":
            row.update(kind=kind, text=w.render("fr", w.words("fr")))
        else:
            paragraphs = w.words(lang)
            text = w.render(lang, paragraphs)
            if kind == "pii":
                values = list(pii_samples(rng).values())
                picked = rng.sample(values, 3)
                glue = "，联系方式：" if lang == "zh" else " Contact: "
                text += glue + ", ".join(picked) + ("。" if lang == "zh" else ".")
                row["pii"] = picked
            elif kind == "toxic":
                word = rng.choice(w.toxic[lang])
                text += (f"你这个{word}。" if lang == "zh" else f" What a {word} this is.")
            else:
                kind = lang
                pool.append((doc_id, lang, paragraphs, text))
            row.update(kind=kind, text=text)
        yield row
        i += 1


def write_corpus(path: str | Path, n_docs: int | None = None, *, target_bytes: int | None = None,
                 seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """Write a generated corpus as JSON Lines: ``n_docs`` records, or until ``target_bytes``.

    Returns ``{"path", "documents", "bytes", "kinds": {kind: count}}``.
    """
    if (n_docs is None) == (target_bytes is None):
        raise ValueError("pass exactly one of n_docs and target_bytes")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds: dict[str, int] = {}
    size = count = 0
    with path.open("w", encoding="utf-8") as f:
        for row in generate_records(n_docs, seed, **kwargs):
            line = json.dumps(row, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            count += 1
            kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
            if target_bytes is not None and size >= target_bytes:
                break
    return {"path": str(path), "documents": count, "bytes": size, "kinds": kinds}
