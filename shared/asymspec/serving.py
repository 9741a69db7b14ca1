"""Running a service process: typed settings from the environment, then uvicorn.

Both services start the same way (`python -m edge_gateway`, `python -m cloud_verifier`):
settings errors become one readable line naming the environment variables, not a trace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import uvicorn
from pydantic import ValidationError


class ServiceSettings(Protocol):
    host: str
    port: int


S = TypeVar("S", bound=ServiceSettings)


def serve(
    name: str, env_prefix: str, load: Callable[[], S], create_app: Callable[[S], Any]
) -> None:
    """Load the settings (exit with a one-line message if they are wrong) and serve."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = load()
    except ValidationError as exc:
        problems = "; ".join(
            f"{env_prefix}{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise SystemExit(f"{name}: bad settings: {problems}") from None
    # One worker: the model, its caches and the batching actor live in this one process.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, workers=1)
