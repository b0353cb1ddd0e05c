"""Thoughts: where a row's reasoning is cut while it is decoded, and what each row remembers of its cuts.

The cache sees every token's text before the token is fed (`KVCache.on_step`). A thought ends at a boundary (a
string such as a paragraph break, or a token id) once it is `min_tokens` long, or at `max_tokens` without one. With
generated summaries (the paper's setting) a thought ends instead after the model writes the end marker following the
begin marker; the tokens between the markers are its summary and the thought's detail ends where the summary begins.
A prompt, and any later multi-token input (a chat turn), is kept in full and never part of a thought.
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_boundary(spec: str) -> tuple[tuple[str, ...], frozenset[int]]:
    """'\\n\\n|id:198' -> (strings, token ids): items split on '|', backslash escapes decoded, 'id:N' is a token id."""
    strings, ids = [], set()
    for item in spec.split("|"):
        if item.startswith("id:") and item[3:].isdigit():
            ids.add(int(item[3:]))
        elif item:
            strings.append(item.encode().decode("unicode_escape"))
    if not strings and not ids:
        raise ValueError(f"boundary={spec!r} names no string or token id")
    return tuple(strings), frozenset(ids)


@dataclass(frozen=True)
class Segmentation:
    """The rule that ends a thought (module docstring)."""

    strings: tuple[str, ...]
    ids: frozenset[int]
    min_tokens: int
    max_tokens: int
    generated: bool = False  # summaries written by the model between the markers, instead of picked
    begin_marker: str = ""
    end_marker: str = ""

    @property
    def longest(self) -> int:
        """Characters of the longest boundary string (1 with none): how far back a new token's text may complete one."""
        return max(map(len, self.strings), default=1)


def group_of(sets: list, layer: int):
    """Layer `layer`'s entry of per-zoom-group `sets`: its own where there is one a layer, else the one shared."""
    return sets[layer if len(sets) > 1 else 0]


class Row:
    """One batch row's segmentation: prompt ranges, finished thoughts, the open thought, the zoom set."""

    def __init__(self, pad: int, end: int):
        self.keep = [(pad, end)]  # kept in full: the prompt (and any later multi-token input)
        self.thoughts: list[tuple[int, int]] = []  # finished thoughts' detail ranges [start, end)
        self.spans: list[tuple[int, int] | None] = []  # generated summary span of each thought (None: pooled)
        self.cur = end  # first position of the open thought
        self.text, self.char_pos = "", []  # open thought's text; (position, char end) per token
        self.summary_start: int | None = None
        self.zoom: list[list[int]] = [[]]  # the zoom set of each zoom group (one, or one a layer: index.Ballot)
        self.tail_from = end  # first tail position kept at the last rebuild

    def zoom_of(self, layer: int) -> list[int]:
        """The thoughts layer `layer` is zoomed in on: its own group's set, or the one set every layer shares."""
        return group_of(self.zoom, layer)

    def feed(self, rule: Segmentation, pos: int, text: str, token: int) -> bool:
        """The token at `pos` (decoded `text`) joins the open thought. True when it ends the thought: the thought is
        recorded (its detail range, and its summary span when generated) and the next one opens after the token."""
        self.text += text
        self.char_pos.append((pos, len(self.text)))
        length = pos + 1 - self.cur
        if rule.generated and self.summary_start is None and rule.begin_marker in self.text:
            at = self.text.index(rule.begin_marker)
            self.summary_start = next(p for p, end in self.char_pos if end > at)
        if self.summary_start is not None:
            ends = rule.end_marker in self.text[self.text.index(rule.begin_marker) + len(rule.begin_marker):]
            span = (self.summary_start, pos + 1) if ends else None
            detail_end = self.summary_start
        else:
            recent = self.text[-(len(text) + rule.longest - 1):] if text else ""
            ends = length >= rule.min_tokens and (token in rule.ids or any(s in recent for s in rule.strings))
            ends, span, detail_end = ends or length >= rule.max_tokens, None, pos + 1
        if ends:
            self.thoughts.append((self.cur, max(detail_end, self.cur + 1)))
            self.spans.append(span)
            self.cur, self.text, self.char_pos, self.summary_start = pos + 1, "", [], None
        return ends

    def take_input(self, past: int, length: int) -> bool:
        """`length` tokens of input after `past` (a chat turn): the open thought ends, the input is kept in full.
        True when a thought was closed."""
        closed = self.cur < past
        if closed:
            self.thoughts.append((self.cur, past))
            self.spans.append(None)
        self.keep.append((past, past + length))
        self.cur = past + length
        return closed
