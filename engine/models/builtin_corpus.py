"""Deterministic training text for the built-in tokenizer (see builtin.py).

Prose from the word lists in data/builtin_words.txt and a small grammar, plus numbers,
code, JSON, markdown and chat-like turns. Randomness comes only from `Rng` (splitmix64
over Python ints), never from `random` or `hash()`, so every machine and Python
version produces the same text.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_WORDS_FILE = Path(__file__).parent / "data" / "builtin_words.txt"
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)


def splitmix64_mix(z: int) -> int:
    """The splitmix64 finaliser of one 64-bit value."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class Rng:
    """splitmix64: output i (from 1) is mix(seed + i * GAMMA mod 2**64)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + GAMMA) & MASK64
        return splitmix64_mix(self.state)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


class Words:
    """The word lists, with irregular forms (`base>form` entries)."""

    def __init__(self, sections: dict[str, list[str]]) -> None:
        self.irregular: dict[str, str] = {}
        self.lists: dict[str, list[str]] = {}
        for name, entries in sections.items():
            bases = []
            for entry in entries:
                base, _, form = entry.partition(">")
                bases.append(base)
                if form:
                    self.irregular[f"{name}:{base}"] = form
            self.lists[name] = bases

    def __getitem__(self, section: str) -> list[str]:
        return self.lists[section]

    def plural(self, noun: str) -> str:
        return self.irregular.get(f"noun:{noun}") or _add_s(noun)

    def past(self, verb: str) -> str:
        form = self.irregular.get(f"verb:{verb}")
        if form:
            return form
        if verb.endswith("e"):
            return verb + "d"
        return verb[:-1] + "ied" if _consonant_y(verb) else verb + "ed"


def _consonant_y(word: str) -> bool:
    return len(word) > 1 and word.endswith("y") and word[-2] not in "aeiou"


def _add_s(word: str) -> str:
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    return word[:-1] + "ies" if _consonant_y(word) else word + "s"


def _ing(verb: str) -> str:
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith("ee") and len(verb) > 2:
        return verb[:-1] + "ing"
    return verb + "ing"


@lru_cache(maxsize=1)
def load_words() -> Words:
    """Parse data/builtin_words.txt: `[section]` headers, whitespace-separated entries."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in _WORDS_FILE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        else:
            current.extend(line.split())
    return Words(sections)


_ONSETS = (
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
    "",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "io")
_UNITS = ("km", "kg", "m", "cm", "ms", "MB", "GB")
_CODAS = ("", "", "n", "r", "l", "s", "th", "nd", "m", "x", "ck", "rt")


def coined_word(rng: Rng) -> str:
    """A pronounceable made-up word of two to four syllables (names, products, places)."""
    return "".join(
        rng.pick(_ONSETS) + rng.pick(_NUCLEI) + rng.pick(_CODAS) for _ in range(2 + rng.below(3))
    )


class _Grammar:
    """Sentences, code and chat from the word lists; every choice drawn from `rng`."""

    def __init__(self, rng: Rng, words: Words) -> None:
        self.r, self.w = rng, words
        self.coined: list[str] = []

    def new_document(self) -> None:
        """Each document coins a few names of its own and keeps using them."""
        self.coined = [coined_word(self.r).capitalize() for _ in range(3)]

    def noun_phrase(self) -> str:
        r, w = self.r, self.w
        k = r.below(12)
        if k < 2:
            return r.pick(self.coined) if r.chance(40) else r.pick(w["name"])
        if k == 2:
            return r.pick(("he", "she", "it", "we", "they", "you", "I"))
        noun = r.pick(w["foreign"]) if r.chance(2) else r.pick(w["noun"])
        noun = w.plural(noun) if r.chance(30) else noun
        adj = r.pick(w["adjective"]) + " " if r.chance(45) else ""
        det = r.pick(
            ("the", "the", "a", "this", "that", "my", "your", "our", "their", "every", "some")
        )
        return f"{det} {adj}{noun}"

    def place_phrase(self) -> str:
        prep = self.r.pick(
            ("in", "on", "at", "near", "behind", "under", "across", "from", "to", "with")
        )
        target = self.r.pick(self.w["place"]) if self.r.chance(30) else self.noun_phrase()
        return f"{prep} {target}"

    def clause(self) -> str:
        r, w = self.r, self.w
        verb = r.pick(w["verb"])
        subject, obj = self.noun_phrase(), self.noun_phrase()
        k = r.below(8)
        if k == 0:
            return f"{subject} {_add_s(verb)} {obj}"
        if k == 1:
            return f"{subject} will {verb} {obj} {r.pick(w['adverb'])}"
        if k == 2:
            return f"{subject} was {r.pick(w['adverb'])} {r.pick(w['adjective'])}"
        if k == 3:
            return f"{subject} is {_ing(verb)} {obj}"
        if k == 4:
            return f"{subject} {w.past(verb)} {obj} {self.place_phrase()}"
        return f"{subject} {w.past(verb)} {obj}"

    def sentence(self) -> str:
        r = self.r
        k = r.below(12)
        if k == 0:
            body = f"why did {self.noun_phrase()} {r.pick(self.w['verb'])} {self.noun_phrase()}?"
        elif k == 1:
            first, conj = self.clause(), r.pick(("and", "but", "because", "while", "so"))
            body = f"{first} {conj} {self.clause()}."
        elif k == 2:
            body = f"{r.pick(self.w['name'])} said, \"{self.clause().capitalize()}.\""
        elif k == 3:
            body = self.number_sentence()
        elif k == 4:
            body = f"{r.pick(self.w['adverb'])}, {self.clause()} {self.place_phrase()}."
        else:
            body = self.clause() + r.pick((".", ".", ".", "!", ";", "..."))
        return body[0].upper() + body[1:]

    def number_sentence(self) -> str:
        r, w = self.r, self.w
        k = r.below(6)
        if k == 0:
            return f"in {1800 + r.below(230)}, {self.clause()}."
        if k == 1:
            return f"the {r.pick(w['noun'])} costs ${r.below(500)}.{r.below(100):02d} today."
        if k == 2:
            month, day, hh, mm = r.pick(MONTHS), 1 + r.below(28), r.below(24), r.below(60)
            return f"on {month} {day} at {hh:02d}:{mm:02d}, {self.clause()}."
        if k == 3:
            a, b = r.below(1000), r.below(1000)
            return f"{a} + {b} = {a + b}, and {a} * {b} = {a * b}."
        if k == 4:
            pct, nouns = r.below(101), w.plural(r.pick(w["noun"]))
            return f"about {pct}% of the {nouns} were {r.pick(w['adjective'])}."
        noun, size, unit = r.pick(w["noun"]), r.below(10000) / 100, r.pick(_UNITS)
        return f"the {noun} is {size:.2f} {unit} long."

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(2 + self.r.below(6))) + "\n\n"

    def identifier(self) -> str:
        r, w = self.r, self.w
        verb, noun = r.pick(w["verb"]), r.pick(w["noun"])
        k = r.below(4)
        if k == 0:
            return f"{verb}_{noun}"
        if k == 1:
            return f"{verb}{noun.capitalize()}"
        if k == 2:
            return f"{noun}_{r.pick(w['code'])}"
        return r.pick(w["code"]) + (str(r.below(10)) if r.chance(20) else "")

    def code(self) -> str:
        r, ident = self.r, self.identifier
        k = r.below(4)
        if k == 0:
            a, b = ident(), ident()
            return (
                f'def {ident()}({a}, {b}=None):\n    """{self.sentence()}"""\n'
                f"    if {b} is None:\n        return [{a}]\n"
                f"    for i in range({r.below(100)}):\n        {a} = {a}.{ident()}({b}, i)\n"
                f"    return {a}\n\n"
            )
        if k == 1:
            name = ident()
            call = f"await {ident()}({ident()}, {{ {ident()}: {r.below(1000)} }})"
            return f"const {name} = {call};\n// {self.sentence()}\n\n"
        if k == 2:
            items = ", ".join(f'"{ident()}": {r.below(10000)}' for _ in range(1 + r.below(4)))
            head = f'"{ident()}": "{self.noun_phrase()}"'
            ok = r.pick(("true", "false", "null"))
            return f'{{{head}, {items}, "ok": {ok}}}\n\n'
        items = "".join(f"- {self.sentence()}\n" for _ in range(2 + r.below(4)))
        return f"## {self.noun_phrase().title()}\n\n{items}\n"

    def chat(self) -> str:
        turns = []
        if self.r.chance(40):
            turns.append(f"System: You are a {self.r.pick(self.w['adjective'])} assistant.")
        for _ in range(1 + self.r.below(3)):
            turns.append(f"User: {self.sentence()}")
            turns.append(f"Assistant: {self.paragraph().strip()}")
        return "\n".join(turns) + "\n\n"

    def document(self) -> str:
        self.new_document()
        k = self.r.below(20)
        if k < 12:
            return self.paragraph()
        if k < 16:
            return self.code()
        return self.chat()


def corpus(seed: int, num_chars: int) -> list[str]:
    """Documents of generated text, at least `num_chars` characters in all."""
    grammar = _Grammar(Rng(seed), load_words())
    docs, total = [], 0
    while total < num_chars:
        docs.append(grammar.document())
        total += len(docs[-1])
    return docs
