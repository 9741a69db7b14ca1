"""`python -m edge_gateway [flags]`: serve the edge gateway with uvicorn (one worker);
`--help` lists every setting with its environment variable."""

from __future__ import annotations

from asymspec.cli import parse_settings
from asymspec.serving import serve
from edge_gateway.app import create_app
from edge_gateway.settings import EdgeSettings

if __name__ == "__main__":
    serve(parse_settings(EdgeSettings, prog="python -m edge_gateway"), create_app)
