"""`python -m cloud_verifier`: serve the cloud verifier with uvicorn (one worker)."""

from __future__ import annotations

import logging

import uvicorn

from cloud_verifier.app import create_app
from cloud_verifier.settings import CloudSettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = CloudSettings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, workers=1)


if __name__ == "__main__":
    main()
