"""Where models come from, read from the environment (prefix ASYMSPEC_): the model cache
that `make models` fills and every service, script and test loads from, and whether a hub
id may be downloaded. Read at each use, so a test or a script that sets the variable sees
it at once."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ModelStoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYMSPEC_", extra="ignore")

    model_cache: Path = Field(
        Path.home() / ".cache" / "asymspec" / "models",
        description="The prepared model cache (the embedded pair, converted checkpoints).",
    )
    allow_download: bool = Field(
        False,
        description="Let transformers download hub ids; off, because this project must run "
        "without network access.",
    )
