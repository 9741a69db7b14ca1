"""`python -m cloud_verifier`: serve the cloud verifier with uvicorn (one worker)."""

from __future__ import annotations

from asymspec.serving import serve
from cloud_verifier.app import create_app
from cloud_verifier.settings import CloudSettings

if __name__ == "__main__":
    serve("cloud_verifier", "ASYMSPEC_CLOUD_", CloudSettings, create_app)
