"""The browser pages of `pagellm serve`: a chat page at `/` and a live engine dashboard at
`/dashboard`, plain static files (HTML, CSS, vanilla JS) under `static/`, served from the
package. They talk to the server only through its public routes (`/v1/...`, `/metrics`);
nothing here knows the engine. `pagellm serve --disable-ui` leaves them out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
# The pages are small and change with the package: browsers revalidate on every load
# instead of running an old script against a newer server.
_NO_CACHE = {"Cache-Control": "no-cache"}


def mount_ui(app: FastAPI) -> None:
    """Adds `/` (chat), `/dashboard` and the pages' assets under `/ui/`. These routes need
    no API key (the server's key guards `/v1` only); the pages send the key themselves."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=_NO_CACHE)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=_NO_CACHE)

    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")
