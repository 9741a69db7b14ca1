"""Write docs/settings.md from the services' settings classes: every setting's flag,
environment variable, default and one-line description, operator settings first, tuning
after. The classes are the one source; `tests/shared/test_settings_doc.py` fails when the
committed page differs from what this prints.

    .venv/bin/python scripts/settings_doc.py > docs/settings.md
"""

from __future__ import annotations

from pydantic_settings import BaseSettings

from asymspec.cli import env_name, flag_name, shadowed_fields
from cloud_verifier.settings import CloudSettings
from edge_gateway.settings import EdgeSettings

# What an operator sets to run the services; the rest tunes them.
OPERATOR = {
    "engine", "threads", "device", "max_sessions", "session_tokens", "dtype", "colocated",
    "mode", "draft_model", "target_model", "served_model_name", "host", "port",
    "cloud_urls", "shared_secret", "edge_id", "cloud_token", "cloud_ca_certs",
    "cloud_certfile", "cloud_keyfile", "allow_plaintext", "ssl_certfile", "ssl_keyfile",
    "ssl_ca_certs", "edge_tokens_file", "revoked_edges_file", "api_keys",
    "max_concurrent_requests", "max_model_len", "fidelity_budget", "num_draft_tokens",
}  # fmt: skip


def default_of(settings_cls: type[BaseSettings], field: str) -> str:
    info = settings_cls.model_fields[field]
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "(empty)"
    return "(empty)" if value in ("", None) else str(value)


def rows(settings_cls: type[BaseSettings], operator: bool) -> list[str]:
    skipped = shadowed_fields(settings_cls)
    out = []
    for field, info in settings_cls.model_fields.items():
        if field in skipped or (field in OPERATOR) != operator:
            continue
        text = " ".join((info.description or "").split())
        out.append(
            f"| `{flag_name(field)}` | `{env_name(settings_cls, field)}` | "
            f"`{default_of(settings_cls, field)}` | {text} |"
        )
    return out


def page() -> str:
    lines = [
        "# Settings",
        "",
        "Every setting is a flag (`python -m edge_gateway --help`, `python -m cloud_verifier "
        "--help`) and an environment variable; a flag wins over the environment. Generated "
        "by `scripts/settings_doc.py` from the settings classes.",
    ]
    for title, cls in (("Edge gateway", EdgeSettings), ("Cloud verifier", CloudSettings)):
        for group, operator in (("operator", True), ("tuning", False)):
            lines += ["", f"## {title}: {group}", ""]
            lines += ["| flag | environment | default | meaning |", "|---|---|---|---|"]
            lines += rows(cls, operator)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
