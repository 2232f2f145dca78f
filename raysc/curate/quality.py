"""Document quality rules: Gopher (quality and repetition), C4 and FineWeb, with their published
default thresholds.

Each rule family turns a document into named measurements (``measure_*``) and the
thresholds (declared once, in ``QualityConfig``: the ``[quality]`` section) into a verdict (``QualityRules.judge``): ``keep`` and, when dropped, the first
rule that failed (``reason``). The measurements are returned too, so the curation report
can histogram them and users can re-threshold without re-reading the data. ``judge_batch`` judges a
batch (as Ray Data hands it to the stage) and computes the n-gram repetition measures for all of it at once
(``raysc.curate.ngrams``).

Sources (thresholds as published and as datatrove ships them):
- Gopher: Rae et al. 2021, "Scaling Language Models", appendix A (quality filter and
  repetition removal);
- C4: Raffel et al. 2020, section 2.2 (line-level heuristics);
- FineWeb: Penedo et al. 2024, the three custom filters.

We write these rules ourselves rather than pull in datatrove: they are a few dozen lines of
string statistics, and datatrove's pipeline runtime would sit beside Ray Data instead of in it.
"""

from __future__ import annotations

import re

from raysc.config.schema import QualityConfig
from raysc.config.syntax import parse_ngram_limits
from raysc.curate.ngrams import ngram_repetition
from raysc.curate.words import words as split_words

STOP_WORDS = {"the", "be", "to", "of", "and", "that", "have", "with"}
BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "–", "-", "*", "·", "‣", "⁃")
ELLIPSES = ("...", "…")
TERMINAL = (".", "!", "?", '"', "'", "”", "’")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
# a whitespace-separated word with a letter in it, matched once each: from its first letter to its end (re's
# \s and \S are str.split()'s whitespace), so counting matches counts such words without a loop over words
_ALPHA_WORD = re.compile(r"[^\W\d_]\S*")


class QualityRules:
    """The rules with their thresholds: a ``QualityConfig``, where each threshold is declared once
    with its published default and help (``[quality]``), its n-gram limits parsed.
    ``skip_domains``: domains judged by the repetition rules only (source code fails prose
    heuristics by design)."""

    def __init__(self, config: QualityConfig | None = None) -> None:
        self.config = config if config is not None else QualityConfig()
        self.top_ngram_max = parse_ngram_limits(self.config.top_ngram_max)
        self.dup_ngram_max = parse_ngram_limits(self.config.dup_ngram_max)
        self.skip_domains = tuple(d.strip() for d in self.config.skip_domains.split(",") if d.strip())

    @classmethod
    def from_config(cls, q: QualityConfig) -> QualityRules:
        """Rules from a ``QualityConfig`` (every threshold configurable under ``[quality]``)."""
        return cls(q)

    def judge(self, text: str, domain: str = "") -> dict:
        """Measurements of every rule family plus ``keep`` and ``reason`` (empty when kept)."""
        return self.judge_batch([text], [domain])[0]

    def judge_batch(self, texts: list[str], domains: list[str]) -> list[dict]:
        """``judge`` of each document; the n-gram repetition measures of the whole batch at once
        (``raysc.curate.ngrams``)."""
        words = [split_words(t) for t in texts]
        grams = ngram_repetition(words, list(self.top_ngram_max), list(self.dup_ngram_max))
        out = []
        for i, (text, domain) in enumerate(zip(texts, domains)):
            m = {
                **measure_gopher(text, words[i]),
                **measure_line_repetition(text),
                **{k: float(v[i]) for k, v in grams.items()},
                **measure_c4(text, self),
                **measure_fineweb(text, self),
            }
            reason = self._first_failure(m, prose=domain not in self.skip_domains)
            out.append({**m, "keep": not reason, "reason": reason})
        return out

    def _first_failure(self, m: dict, prose: bool) -> str:
        q = self.config
        checks = [
            ("gopher_rep_dup_line_frac", m["dup_line_frac"] > q.max_dup_line_frac),
            ("gopher_rep_dup_para_frac", m["dup_para_frac"] > q.max_dup_para_frac),
            ("gopher_rep_dup_line_char_frac", m["dup_line_char_frac"] > q.max_dup_line_char_frac),
            ("gopher_rep_dup_para_char_frac", m["dup_para_char_frac"] > q.max_dup_para_char_frac),
            *[(f"gopher_rep_top_{n}gram", m[f"top_{n}gram_frac"] > t) for n, t in self.top_ngram_max.items()],
            *[(f"gopher_rep_dup_{n}gram", m[f"dup_{n}gram_frac"] > t) for n, t in self.dup_ngram_max.items()],
        ]
        if prose:
            checks = [
                ("gopher_min_words", m["words"] < q.min_words),
                ("gopher_max_words", m["words"] > q.max_words),
                ("gopher_avg_word_len", not q.min_avg_word_len <= m["avg_word_len"] <= q.max_avg_word_len),
                ("gopher_symbol_word_ratio", m["symbol_word_ratio"] > q.max_symbol_word_ratio),
                ("gopher_bullet_lines", m["bullet_lines_ratio"] > q.max_bullet_lines_ratio),
                ("gopher_ellipsis_lines", m["ellipsis_lines_ratio"] > q.max_ellipsis_lines_ratio),
                ("gopher_alpha_words", m["alpha_words_ratio"] < q.min_alpha_words_ratio),
                ("gopher_stop_words", m["stop_words"] < q.min_stop_words),
                *checks,
                ("c4_lorem_ipsum", m["c4_lorem_ipsum"]),
                ("c4_curly_bracket", m["c4_curly_bracket"]),
                ("c4_min_sentences", m["c4_sentences"] < q.c4_min_sentences),
                ("fineweb_line_punct", m["fw_line_punct_ratio"] < q.fw_min_line_punct_ratio),
                ("fineweb_short_lines", m["fw_short_line_ratio"] > q.fw_max_short_line_ratio),
                ("fineweb_dup_line_chars", m["fw_dup_line_char_ratio"] > q.fw_max_dup_line_char_ratio),
                ("fineweb_newline_ratio", m["fw_newline_ratio"] > q.fw_max_newline_ratio),
            ]
        return next((name for name, failed in checks if failed), "")


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def measure_gopher(text: str, words: list[str] | None = None) -> dict:
    """Gopher's quality measures; ``words``: ``minhash.words(text)`` when the caller has them."""
    w = text.split()
    n = max(len(w), 1)
    lines = _lines(text)
    nl = max(len(lines), 1)
    return {
        "words": len(w),
        "avg_word_len": len("".join(w)) / n,
        "symbol_word_ratio": (text.count("#") + sum(text.count(e) for e in ELLIPSES)) / n,
        "bullet_lines_ratio": sum(ln.startswith(BULLETS) for ln in lines) / nl,
        "ellipsis_lines_ratio": sum(ln.endswith(ELLIPSES) for ln in lines) / nl,
        "alpha_words_ratio": len(_ALPHA_WORD.findall(text)) / n,
        "stop_words": sum(1 for x in (split_words(text) if words is None else words) if x in STOP_WORDS),
    }


def _dup_fracs(items: list[str]) -> tuple[float, float]:
    """(share of items that repeat an earlier one, share of characters in those repeats)."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_n = dup_chars = 0
    for x in items:
        if x in seen:
            dup_n += 1
            dup_chars += len(x)
        seen.add(x)
    return dup_n / len(items), dup_chars / max(sum(map(len, items)), 1)


def measure_line_repetition(text: str) -> dict:
    """Gopher's repeated lines and paragraphs (its n-gram measures: ``raysc.curate.ngrams``)."""
    lines = _lines(text)
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    line_frac, line_chars = _dup_fracs(lines)
    para_frac, para_chars = _dup_fracs(paras)
    return {
        "dup_line_frac": line_frac,
        "dup_line_char_frac": line_chars,
        "dup_para_frac": para_frac,
        "dup_para_char_frac": para_chars,
    }


def measure_c4(text: str, rules: QualityRules) -> dict:
    """C4's document-level signals and its line filter (lines kept: terminal punctuation, at
    least ``c4_min_words_per_line`` words, no 'javascript', no policy boilerplate)."""
    lower = text.lower()
    kept = [
        ln
        for ln in _lines(text)
        if ln.endswith(TERMINAL)
        and len(ln.split()) >= rules.config.c4_min_words_per_line
        and "javascript" not in ln.lower()
        and not any(p in ln.lower() for p in C4_POLICY)
        and max((len(x) for x in ln.split()), default=0) <= rules.config.c4_max_word_len
    ]
    kept_text = " ".join(kept)
    sentences = len([s for s in re.split(r"(?<=[.!?])\s+", kept_text) if s.strip()]) if kept_text else 0
    return {
        "c4_lorem_ipsum": "lorem ipsum" in lower,
        "c4_curly_bracket": "{" in text,
        "c4_kept_lines_ratio": len(kept) / max(len(_lines(text)), 1),
        "c4_sentences": sentences,
    }


def measure_fineweb(text: str, rules: QualityRules) -> dict:
    lines = _lines(text)
    nl = max(len(lines), 1)
    _, dup_chars = _dup_fracs(lines)
    return {
        "fw_line_punct_ratio": sum(ln.endswith(TERMINAL) for ln in lines) / nl,
        "fw_short_line_ratio": sum(len(ln) <= rules.config.fw_short_line_chars for ln in lines) / nl,
        "fw_dup_line_char_ratio": dup_chars,
        "fw_newline_ratio": text.count("\n") / max(len(text.split()), 1),
    }
