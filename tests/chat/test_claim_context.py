"""The prompt's context arrives with the claim; chat reads the history separately only when the claim's is cut."""

from __future__ import annotations

from chatmesh.chat.clients import whole_context as _whole_context
from chatmesh.v1 import common_pb2, store_pb2


def claimed(first_index: int | None, summary_through: int | None) -> store_pb2.TurnClaimed:
    out = store_pb2.TurnClaimed(lease_id="l")
    view = out.context
    view.conversation.conversation_id = "c"
    if summary_through is not None:
        view.summary.text = "earlier"
        view.summary.covers_through_index = summary_through
    if first_index is not None:
        for i in range(first_index, first_index + 3):
            view.messages.append(common_pb2.Message(index=i, role=common_pb2.ROLE_USER, content=f"m{i}"))
    return out


def test_no_context_means_read_it() -> None:
    assert _whole_context(store_pb2.TurnClaimed(lease_id="l")) is None


def test_whole_history_without_a_summary_is_used() -> None:
    view = _whole_context(claimed(0, None))
    assert view is not None and [m.index for m in view.messages] == [0, 1, 2]


def test_history_right_after_the_summary_is_used() -> None:
    assert _whole_context(claimed(6, 5)) is not None


def test_an_empty_history_is_whole() -> None:
    assert _whole_context(claimed(None, None)) is not None
    assert _whole_context(claimed(None, 5)) is not None


def test_a_cut_history_is_read_again() -> None:
    assert _whole_context(claimed(8, 5)) is None  # messages 6 and 7 were not returned
    assert _whole_context(claimed(4, None)) is None
