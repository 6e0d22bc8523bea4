"""GET /models and /models/{id}: the model this mesh serves, with its context length (`context_length`, and vLLM's
`max_model_len`, which some clients read)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway.openai.surface import Surface, owner_of, surface_of


def model_json(surface: Surface) -> dict[str, Any]:
    return {"id": surface.model, "object": "model", "created": surface.created_at, "owned_by": "chatmesh",
            "context_length": surface.context_tokens, "max_model_len": surface.context_tokens}


async def listing(request: Request) -> Response:
    surface = surface_of(request)
    await owner_of(request, surface)
    return JSONResponse({"object": "list", "data": [model_json(surface)]})


async def one(request: Request) -> Response:
    surface = surface_of(request)
    await owner_of(request, surface)
    surface.check_model(request.path_params["model"])
    return JSONResponse(model_json(surface))
