"""`python -m cloud_verifier [flags]`: serve the cloud verifier with uvicorn (one worker);
`--help` lists every setting with its environment variable."""

from __future__ import annotations

from asymspec.cli import parse_settings
from asymspec.serving import serve
from cloud_verifier.app import create_app
from cloud_verifier.settings import CloudSettings

if __name__ == "__main__":
    serve(parse_settings(CloudSettings, prog="python -m cloud_verifier"), create_app)
