"""GET /models and /models/{id}: the model this mesh serves, with its context length (`context_length`, and vLLM's
`max_model_len`, which some clients read).

The served model is the model profile's (CHATMESH_MODEL, chatmesh.model.profile: the id chat renders with and
the engines report, e.g. `SmolLM2-135M-Instruct.Q4_1` for the default), so the listing cannot disagree with what
answers. CHATMESH_OPENAI_MODEL, when set, overrides the id (a name clients already use); the context length is
the smaller of the profile's and chat's CHATMESH_CONTEXT_TOKENS (what a request can actually use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.chat import settings as chat_settings
from chatmesh.gateway import settings
from chatmesh.gateway.openai.surface import Surface, owner_of, surface_of
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config
from chatmesh.model import assets, profile
from chatmesh.model import settings as model_settings

log = logs.get("chatmesh.gateway.openai")


@dataclass(frozen=True)
class Served:
    model: str
    context_tokens: int


def served_model(cfg: Config) -> Served:
    """The model id and context length the surface lists (see the module docstring). Loads the profile (a
    blocking read of the model's files: call it off the event loop). Without the model's files the id is the
    CHATMESH_MODEL value itself, logged: chat and the engines refuse to serve then anyway."""
    context = cfg[chat_settings.CONTEXT_TOKENS]
    try:
        p = profile.load(cfg)
    except (assets.ModelMissing, profile.ProfileError) as err:
        log.warning("openai_model_profile_missing", error=type(err).__name__, model=cfg[model_settings.MODEL])
        return Served(cfg[settings.OPENAI_MODEL] or cfg[model_settings.MODEL], context)
    return Served(cfg[settings.OPENAI_MODEL] or p.model_id, min(context, p.context_tokens))


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
