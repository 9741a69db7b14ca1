"""`python -m edge_gateway`: serve the edge gateway with uvicorn (one worker)."""

from __future__ import annotations

from asymspec.serving import serve
from edge_gateway.app import create_app
from edge_gateway.settings import EdgeSettings

if __name__ == "__main__":
    serve("edge_gateway", "ASYMSPEC_EDGE_", EdgeSettings, create_app)
