"""The control endpoint (stdlib http.server, so the sidecar image needs no packages).

GET /health                 200 once a profile is applied
GET /profile                the active profile, backend and whether delay is emulated
PUT /profile/{name}         switch at runtime; query: delay_ms, jitter_ms, loss_pct
GET /metrics                Prometheus text (see metrics.py)
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from asymspec.links import get_profile

from .metrics import CONTENT_TYPE, render_metrics
from .shaper import LinkShaper, ShapeError

log = logging.getLogger(__name__)

_PROFILE_PREFIX = "/profile/"
_OVERRIDES = ("delay_ms", "jitter_ms", "loss_pct")


class ControlServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, shaper: LinkShaper, host: str, port: int) -> None:
        self.shaper = shaper
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        state = self.server.shaper.state
        if path == "/metrics":
            self._send(HTTPStatus.OK, render_metrics(state).encode(), CONTENT_TYPE)
        elif path in ("/profile", "/health"):
            if state is None:
                self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "no profile applied"})
            elif path == "/health":
                self._send_json(HTTPStatus.OK, {"status": "ok"})
            else:
                self._send_json(HTTPStatus.OK, state.as_dict())
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})

    def do_PUT(self) -> None:
        url = urlsplit(self.path)
        name = url.path.removeprefix(_PROFILE_PREFIX)
        if not url.path.startswith(_PROFILE_PREFIX) or not name or "/" in name:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no route PUT {url.path}"})
            return
        try:
            overrides = _parse_overrides(url.query)
            profile = get_profile(name, **overrides)
        except ValueError as exc:
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        try:
            state = self.server.shaper.apply(profile)
        except ShapeError as exc:
            log.error("switch to %s failed: %s", name, exc)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)})
            return
        self._send_json(HTTPStatus.OK, state.as_dict())

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode() + b"\n", "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _parse_overrides(query: str) -> dict[str, float]:
    params = parse_qs(query, strict_parsing=False)
    unknown = set(params) - set(_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown query parameters {sorted(unknown)}; allowed: {_OVERRIDES}")
    try:
        return {key: float(values[-1]) for key, values in params.items()}
    except ValueError as exc:
        raise ValueError(f"delay_ms, jitter_ms and loss_pct must be numbers: {exc}") from None
