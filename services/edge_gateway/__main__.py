"""`python -m edge_gateway`: serve the edge gateway with uvicorn (one worker)."""

from __future__ import annotations

import logging

import uvicorn
from pydantic import ValidationError

from edge_gateway.app import create_app
from edge_gateway.settings import EdgeSettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = EdgeSettings()
    except ValidationError as exc:
        problems = "; ".join(
            f"ASYMSPEC_EDGE_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        raise SystemExit(f"edge_gateway: bad settings: {problems}") from None
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, workers=1)


if __name__ == "__main__":
    main()
