"""`python -m cloud_verifier`: serve the cloud verifier with uvicorn (one worker)."""

from __future__ import annotations

import logging

import uvicorn
from pydantic import ValidationError

from cloud_verifier.app import create_app
from cloud_verifier.settings import CloudSettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = CloudSettings()
    except ValidationError as exc:
        problems = "; ".join(
            f"ASYMSPEC_CLOUD_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        raise SystemExit(f"cloud_verifier: bad settings: {problems}") from None
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, workers=1)


if __name__ == "__main__":
    main()
