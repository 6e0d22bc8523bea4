"""The OpenAI-compatible surface of the edge, under /openai/v1: Models, Chat Completions, Responses and
Conversations over chatmesh's own conversations, limits and idempotent turns, so the official `openai` SDK, Open
WebUI and LibreChat work unchanged (`OPENAI_BASE_URL=http://host:8080/openai/v1`).

- `routes`: the route table; each route authenticates (`frontends.principal_of`), validates (`wire`), then
  calls ChatService with the principal's owner id.
- `turns`: which stored conversation a request continues, and which turn id it is (continuity, idempotency).
- `history`: the per-owner digest index behind continuity.
- `completions`, `responses`, `conversations`, `models`: the four APIs' bodies and event streams.
- `errors`: OpenAI's error shape with the status codes its SDK maps to its exception classes.
"""
