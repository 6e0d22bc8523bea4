"""The OpenAI surface's layers hold domain values: protobuf (chatmesh.v1) is imported only by the two modules that
call ChatService (and convert at that call), never by the request parsing, the framings, the Response object, the
records or the surface's wiring. Checked by AST over gateway/chatmesh/gateway/openai/ (and the reply events of
chatmesh.gateway.events hold no protobuf field)."""

from __future__ import annotations

import ast
from pathlib import Path

import chatmesh.gateway.openai as openai_pkg

# The modules that call ChatService (stored.py every call but the two that open a turn, turns.py those).
CALLERS = {"stored", "turns"}
PACKAGE = Path(openai_pkg.__file__).parent


def _imports_protobuf(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chatmesh.v1"):
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno}" for a in node.names if a.name.startswith("chatmesh.v1")]
    return found


def test_only_the_modules_that_call_chat_import_protobuf() -> None:
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    assert CALLERS <= set(modules), CALLERS - set(modules)
    assert _imports_protobuf(modules["turns"]), "the check finds nothing where protobuf is imported"
    leaks = [hit for name, path in sorted(modules.items()) if name not in CALLERS for hit in _imports_protobuf(path)]
    assert leaks == [], f"protobuf outside the modules that call chat: {leaks}"


def test_the_domain_values_between_layers_carry_no_protobuf() -> None:
    """The values the layers pass one another (request, options, reply events, stored messages) hold only domain
    types: no field of theirs is annotated with a protobuf message."""
    for name in ("wire", "response_events", "response_object", "records", "tool_wire"):
        source = (PACKAGE / f"{name}.py").read_text()
        assert "_pb2" not in source, name
    for path in (PACKAGE.parent / "events.py", PACKAGE.parent / "relay.py"):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.startswith("Reply")):
            annotations = [ast.unparse(s.annotation) for s in cls.body if isinstance(s, ast.AnnAssign)]
            assert not any("_pb2" in a for a in annotations), (cls.name, annotations)
