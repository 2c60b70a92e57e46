"""The browser pages of `pagellm serve`: a chat page at `/` and a live engine dashboard at
`/dashboard`, plain static files (HTML, CSS, vanilla JS) under `static/`, served from the
package. They talk to the server only through its public routes (`/v1/...`, `/metrics`);
nothing here knows the engine. `pagellm serve --disable-ui` leaves them out.
"""

from __future__ import annotations

import base64
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
# The pages are small and change with the package: browsers revalidate on every load
# instead of running an old script against a newer server.
_NO_CACHE = {"Cache-Control": "no-cache"}
# A transparent 1x1 PNG for /favicon.ico: the pages say they have no icon, but a browser
# still asks for one when it shows something else of the server (a stylesheet, a JSON
# reply), and a 404 there is an error in its console and a line in the server's log.
_FAVICON = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAAC0lEQVR42mNgAAIAAAUAAen63NgAAAAASUVORK5CYII=")


def mount_ui(app: FastAPI) -> None:
    """Adds `/` (chat), `/dashboard`, the pages' assets under `/ui/` and a blank
    `/favicon.ico`. These routes need no API key (the server's key guards `/v1` only); the
    pages send the key themselves."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=_NO_CACHE)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=_NO_CACHE)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(_FAVICON, media_type="image/png", headers={"Cache-Control": "max-age=86400"})

    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")
