"""The web chat page at `/`: static HTML, CSS and JavaScript shipped in the package (no build step).

The page gets a strict Content-Security-Policy: scripts, styles, images and connections from this origin only,
no inline script, no framing. So even a reply that slipped past the sanitiser could not load an image from, or
send a request to, another host. The page renders Markdown itself by building DOM nodes (text is never parsed as
HTML), so model output cannot inject markup."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers=SECURITY_HEADERS)


def static() -> StaticFiles:
    return StaticFiles(directory=STATIC)
