"""Output sanitising of streamed replies: rendering is an exit.

A reply rendered by a client can carry data to someone else's server: an image is fetched without a click, and
a link's URL can hold whatever the model was tricked into writing. So the edge rewrites the reply text as it
streams, before any client sees it:

- Markdown images `![alt](url)` and `![alt][ref]` are removed; of raw HTML only plain text tags (`<b>`, `<code>`,
  `<li>`, ...) survive, re-emitted without attributes, so `<img>`, `<svg>`, `<iframe>`, `<style>`, event handlers
  and everything else that could load or run something is removed (their text content stays);
- inline links `[text](url)` keep their URL only when it is http(s) to an allowlisted host (or a subdomain of
  one); otherwise they are reduced to their (sanitised) text; HTML `<a href>` likewise loses its tags;
  autolinks `<https://...>` off the list become the bare URL text;
- reference links `[text][ref]` become their text and reference definitions `[ref]: url` are dropped, because a
  definition can come after its use and we cannot decide the use when it streams.

Streaming: a construct can be split across deltas (`![a` | `](http://x)`). `feed` emits everything up to the
first position that could still open a construct and holds the rest; `flush` (at the end of the turn) decides
what is held with no more text to come. A held construct longer than `max_hold` characters is given up: its
opening bracket is escaped (`\\[`), so it renders as literal text, and scanning goes on. The output therefore never
depends on where the chunk boundaries fell, except for escapes in pathologically long brackets.

Code spans are not special-cased on purpose: a tracker that disagreed with the client's renderer about where
code starts would let an image through; mangling a rare `](` inside code is the safer failure.
"""

from __future__ import annotations

import html
import re
from urllib.parse import urlsplit

MAX_HOLD = 2048

_TEXT_TAGS = frozenset({"b", "i", "em", "strong", "code", "pre", "kbd", "samp", "sub", "sup", "br", "p", "ul",
                        "ol", "li", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "del", "s", "u",
                        "table", "thead", "tbody", "tr", "th", "td"})
_TAG = re.compile(r"<\s*(/?)\s*([a-zA-Z][a-zA-Z0-9-]*)")
_HREF = re.compile(r"""href\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))""", re.IGNORECASE)
_AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]{1,31}:[^\s<>]*)>")


class _Incomplete(Exception):
    """The construct at this position needs more text to decide."""


def host_allowed(url: str, allowlist: tuple[str, ...]) -> bool:
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return False
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return False
    host = parts.hostname.lower().rstrip(".")
    return any(host == allowed or host.endswith("." + allowed) for allowed in allowlist)


class Sanitiser:
    """One reply's streaming sanitiser: `feed(delta) -> safe text`, then `flush() -> safe tail`."""

    def __init__(self, allowlist: tuple[str, ...] = (), max_hold: int = MAX_HOLD):
        self._allow = allowlist
        self._max_hold = max_hold
        self._held = ""
        self._dropped_anchors = 0  # `<a>` tags removed whose `</a>` is still to come

    def feed(self, text: str) -> str:
        out, self._held = self._scan(self._held + text, final=False)
        return out

    def flush(self) -> str:
        out, rest = self._scan(self._held, final=True)
        self._held = ""
        assert not rest
        return out

    def whole(self, text: str) -> str:
        """Sanitises a complete text (a stored message)."""
        return self.feed(text) + self.flush()

    def _scan(self, buf: str, final: bool) -> tuple[str, str]:
        out: list[str] = []
        i = 0
        n = len(buf)
        while i < n:
            j = _next_special(buf, i)
            out.append(buf[i:j])
            if j >= n:
                break
            try:
                text, i = self._construct(buf, j, final)
            except _Incomplete:
                if n - j <= self._max_hold:
                    return "".join(out), buf[j:]
                text, i = _give_up(buf, j)
            out.append(text)
        return "".join(out), ""

    def _construct(self, buf: str, i: int, final: bool) -> tuple[str, int]:
        """Decides the construct starting at buf[i]: returns its safe text and the index after it."""
        c = buf[i]
        nxt = _char(buf, i + 1, final)
        if c == "\\":
            return buf[i:i + 2], i + 2
        if c == "!":
            if nxt != "[":
                return "!", i + 1
            return self._bracket(buf, i + 1, final, image=True)
        if c == "[":
            return self._bracket(buf, i, final, image=False)
        return self._angle(buf, i, final)

    def _bracket(self, buf: str, i: int, final: bool, image: bool) -> tuple[str, int]:
        start = i - 1 if image else i
        close = _matching(buf, i, "[", "]")
        if close is None or close == _NEVER:
            if close is None and not final:
                raise _Incomplete
            return _literal(buf, start, image)
        inner = buf[i + 1:close]
        after = _char(buf, close + 1, final)
        if after == "(":
            end = _matching(buf, close + 1, "(", ")")
            if end is None or end == _NEVER:
                if end is None and not final:
                    raise _Incomplete
                return _literal(buf, start, image)
            if image:
                return "", end + 1
            raw = buf[close + 2:end]
            text = Sanitiser(self._allow).whole(inner)
            # An allowed link keeps a plain URL only: markup, quotes or a title in the destination could carry
            # an image or an attribute through, so such a link is reduced to its text like an off-list one.
            if host_allowed(_destination(raw), self._allow) and _plain_url(raw):
                return f"[{text}]({raw})", end + 1
            return text, end + 1
        if after == "[":
            end = _matching(buf, close + 1, "[", "]")
            if end is None or end == _NEVER:
                if end is None and not final:
                    raise _Incomplete
                return _literal(buf, start, image)
            return ("" if image else Sanitiser(self._allow).whole(inner)), end + 1
        if after == ":" and not image:
            eol = buf.find("\n", close)
            if eol < 0:
                if not final:
                    raise _Incomplete
                return "", len(buf)
            return "", eol + 1
        return _literal(buf, start, image)

    def _angle(self, buf: str, i: int, final: bool) -> tuple[str, int]:
        nxt = _char(buf, i + 1, final)
        if not (nxt.isalpha() or nxt in "/!"):
            return "<", i + 1
        close = buf.find(">", i)
        if close < 0:
            if not final:
                raise _Incomplete
            return "", len(buf)  # an unterminated tag at the very end: dropped
        if buf.find("<", i + 1, close) >= 0:
            return "<", i + 1  # no tag: a `<` before the `>` starts the next candidate
        tag = buf[i:close + 1]
        auto = _AUTOLINK.fullmatch(tag)
        if auto:
            return (tag if host_allowed(auto.group(1), self._allow) else auto.group(1)), close + 1
        m = _TAG.match(tag)
        if m is None:
            return "<", i + 1  # `<!...`: not a tag we know, so its inside is scanned like any text
        closing, name = m.group(1) == "/", m.group(2).lower()
        if name == "a":
            if closing:
                if self._dropped_anchors:
                    self._dropped_anchors -= 1
                    return "", close + 1
                return "</a>", close + 1
            href = _HREF.search(tag)
            url = next((g for g in href.groups() if g is not None), "") if href else ""
            if host_allowed(url, self._allow):
                return f'<a href="{html.escape(url.strip(), quote=True)}">', close + 1
            self._dropped_anchors += 1
            return "", close + 1
        if name in _TEXT_TAGS:  # re-emitted bare: attributes (handlers, styles, sources) never pass
            return f"</{name}>" if closing else f"<{name}>", close + 1
        return "", close + 1  # media and every other tag: removed, their text content stays


def _next_special(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] not in "\\![<":
        i += 1
    return i


def _char(buf: str, i: int, final: bool) -> str:
    if i < len(buf):
        return buf[i]
    if final:
        return ""
    raise _Incomplete


_NEVER = -1


def _matching(buf: str, i: int, open_c: str, close_c: str) -> int | None:
    """Index of the bracket closing buf[i] (== open_c), skipping backslash escapes and nested pairs; None when
    more text could still close it, `_NEVER` when a blank line came first."""
    depth = 0
    j = i
    n = len(buf)
    while j < n:
        c = buf[j]
        if c == "\\":
            j += 2
            continue
        if c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return j
        elif c == "\n" and j + 1 < n and buf[j + 1] == "\n":
            return _NEVER  # a blank line ends any inline construct
        j += 1
    return None


_NOT_IN_PLAIN_URL = frozenset("<>\"'`\\ \t\r\n")


def _plain_url(raw: str) -> bool:
    return bool(raw) and not any(c in _NOT_IN_PLAIN_URL for c in raw)


def _destination(raw: str) -> str:
    dest = raw.strip()
    if dest.startswith("<"):
        end = dest.find(">")
        return dest[1:end] if end > 0 else dest[1:]
    return dest.split()[0] if dest.split() else ""


def _literal(buf: str, start: int, image: bool) -> tuple[str, int]:
    """An opening bracket that is no construct: emitted escaped after `!` so `!` + a later `[..](..)` cannot
    form an image; a plain `[` is emitted as is and scanning goes on inside it."""
    if image:
        return "!\\[", start + 2
    return "[", start + 1


def _give_up(buf: str, j: int) -> tuple[str, int]:
    match buf[j]:
        case "!":
            return ("!\\[", j + 2) if buf[j + 1:j + 2] == "[" else ("!", j + 1)
        case "[":
            return "\\[", j + 1
        case "<":
            return "&lt;", j + 1
        case _:
            return buf[j], j + 1
