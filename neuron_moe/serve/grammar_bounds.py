"""Bounds on an untrusted grammar, checked on its text before llguidance compiles it.

llguidance compiles a grammar by recursion over its rules: a Lark grammar of ~2,800 chained rules,
or a JSON schema of ~1,000 chained `$ref`s, overflows an 8 MiB thread stack and takes the process
down (a segfault, not an exception). Its own limits (`LLParserLimits`: items in an Earley row, lexer
fuel, grammar size) are met only at a step of the generation, after the response began: a regex
`a{1000000}` or 20,000 alternatives in one rule pass the compile and fail at the first token. The
bounds here refuse those shapes from the text, with a message naming the bound, far below the
points where llguidance fails (grammar.py compiles on a thread with a 256 MiB stack besides, so a
grammar just inside them is ~30 times short of a crash).

`problem(kind, text)` is the first bound a grammar passes (None: within all of them); the caller
names the request field.
"""

from __future__ import annotations

import json
import re

MAX_BYTES = 256 * 1024  # a grammar's text: the Lark / GBNF grammar, the regex, the schema, the choices as JSON
MAX_RULES = 1000  # rules in a Lark / GBNF grammar; `$ref`s in a JSON schema (each a rule it compiles to)
MAX_ALTERNATIVES = 1000  # `|` in one rule (llguidance's Earley row holds at most 2,000 items)
MAX_CHOICES = 1000  # guided_choice's options (one Earley row of them)
MAX_DEPTH = 64  # nesting of groups in a grammar or regex, of objects and arrays in a schema
MAX_REPETITION = 10_000  # a repetition count, times the counts of the groups around it

_COUNT = r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}"  # {m}, {m,}, {m,n}
# a regex's tokens: an escape, a class, a count, a group's ends, and runs of plain atoms
_REGEX = re.compile(
    rf"(?P<count>{_COUNT})|(?P<open>\()|(?P<close>\))|\\(?:[pPxu]\{{[^}}]*\}}|.)|\[\^?\]?(?:[^\]\\]|\\.)*\]|[^\\\[(){{}}*+?|]+|.",
    re.S,
)
# a grammar's tokens: a rule's head (at a line's start), a string, a comment, a /regex/ (Lark) or a
# class (GBNF), a count ({m,n}; Lark's ~ m..n), a group's ends, an alternative
_HEAD = r"(?P<head>^[ \t]*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?[ \t]*(?:::=|:(?!:)))"
_TAIL = rf"""|(?P<count>{_COUNT}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?)|(?P<open>[(\[{{])|(?P<close>[)\]}}])|(?P<bar>\|)"""
_LARK = re.compile(_HEAD + r"""|"(?:[^"\\\n]|\\.)*"?|//[^\n]*|(?P<regex>/(?:[^/\\\n]|\\.)*/?)""" + _TAIL, re.M)
_GBNF = re.compile(_HEAD + r"""|"(?:[^"\\\n]|\\.)*"?|\#[^\n]*|\[\^?\]?(?:[^\]\\]|\\.)*\]""" + _TAIL, re.M)


def problem(kind: str, text: str) -> str | None:
    """The first bound that the grammar of `kind` (grammar.KINDS) with `text` passes, as a message;
    None if it passes none."""
    size = len(text.encode())
    if size > MAX_BYTES:
        return f"the grammar is {size} bytes; at most {MAX_BYTES} are accepted"
    if kind == "json":
        return _schema_problem(json.loads(text))
    if kind == "regex":
        return regex_problem(text)
    if kind == "choice":
        n = len(json.loads(text))
        return f"{n} choices; at most {MAX_CHOICES} are accepted" if n > MAX_CHOICES else None
    return _grammar_problem(text)


def _count(match: re.Match) -> int:
    """The largest number in a count's match ({m,n}: n; {m,}: m)."""
    return max(int(g) for g in match.groups() if g and g.isdigit())


def _repetition(count: int, around: str = " (times the counts of the groups around it)") -> str:
    return f"a repetition count of {count}{around}; at most {MAX_REPETITION} are accepted"


def _nesting(depth: int) -> str:
    return f"groups nested {depth} deep; at most {MAX_DEPTH} are accepted"


def regex_problem(regex: str) -> str | None:
    """A regex's nesting past MAX_DEPTH, or a repetition count past MAX_REPETITION (the product of a
    count and those of the groups it sits in: `((a{100}){100}){100}` is 1,000,000)."""
    frames = [[1, 1]]  # per open group: [the largest product inside it, the last atom's product]
    for token in _REGEX.finditer(regex):
        frame = frames[-1]
        if token["count"]:
            frame[1] *= _count(token)
            frame[0] = max(frame[0], frame[1])
            if frame[1] > MAX_REPETITION:
                return _repetition(frame[1])
        elif token["open"]:
            frames.append([1, 1])
            if len(frames) - 1 > MAX_DEPTH:
                return _nesting(len(frames) - 1)
        elif token["close"] and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        else:
            frame[1] = 1  # an atom: a character, an escape or a class
    return None


def _schema_problem(schema) -> str | None:
    """A schema nested past MAX_DEPTH, with more `$ref`s than MAX_RULES, or with a `pattern` (or a
    `patternProperties` key) past a regex bound."""
    refs, todo = 0, [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            return f"the schema is nested {depth} deep; at most {MAX_DEPTH} are accepted"
        if isinstance(value, dict):
            refs += "$ref" in value
            patterns = [value.get("pattern"), *(value.get("patternProperties") or {})]
            for pattern in patterns:
                found = regex_problem(pattern) if isinstance(pattern, str) else None
                if found:
                    return f"pattern {pattern[:40]!r}: {found}"
            todo += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            todo += [(v, depth + 1) for v in value]
    return f"{refs} $refs; at most {MAX_RULES} are accepted" if refs > MAX_RULES else None


def _grammar_problem(text: str) -> str | None:
    """A Lark or GBNF grammar past MAX_RULES, MAX_ALTERNATIVES in a rule, MAX_DEPTH, or a repetition
    past MAX_REPETITION (in a rule, or in a /regex/ terminal). Strings, regexes and comments are
    skipped; GBNF's [...] is a character class, Lark's [...] an optional group."""
    rules = alternatives = depth = 0
    for token in (_GBNF if "::=" in text else _LARK).finditer(text):
        if token["head"]:
            rules, alternatives = rules + 1, 0
            if rules > MAX_RULES:
                return f"more than {MAX_RULES} rules; at most {MAX_RULES} are accepted"
        elif token["count"] and _count(token) > MAX_REPETITION:
            return _repetition(_count(token), "")
        elif token["open"]:
            depth += 1
            if depth > MAX_DEPTH:
                return _nesting(depth)
        elif token["close"]:
            depth = max(0, depth - 1)
        elif token["bar"]:
            alternatives += 1
            if alternatives > MAX_ALTERNATIVES:
                return f"more than {MAX_ALTERNATIVES} alternatives in a rule; at most {MAX_ALTERNATIVES} are accepted"
        elif token.lastgroup == "regex":
            found = regex_problem(token[0][1:-1])
            if found:
                return f"the regex at character {token.start()}: {found}"
    return None
