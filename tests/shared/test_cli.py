"""The services' command lines, generated from their settings classes: every setting a flag
with its environment variable and a one-line description; flags over the environment; an
unknown flag or a bad value exits 2 with one line naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic_settings import BaseSettings

from asymspec.cli import build_parser, env_name, flag_name, parse_settings, shadowed_fields
from cloud_verifier.settings import CloudSettings
from edge_gateway.settings import EdgeSettings

SERVICES: dict[str, type[BaseSettings]] = {
    "edge_gateway": EdgeSettings,
    "cloud_verifier": CloudSettings,
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_setting_has_a_flag_an_env_variable_and_a_one_line_description(
    service: str,
) -> None:
    settings_cls = SERVICES[service]
    help_text = build_parser(settings_cls, f"python -m {service}").format_help()
    shadowed = shadowed_fields(settings_cls)
    for field, info in settings_cls.model_fields.items():
        assert info.description and "\n" not in info.description, field
        env = env_name(settings_cls, field)
        assert env.startswith("ASYMSPEC_") and env.isupper(), (field, env)
        assert f"env: {env})" in " ".join(help_text.split()), field
        assert (flag_name(field) in help_text) != (field in shadowed), field


def test_a_variable_two_fields_read_gets_one_flag() -> None:
    """The edge's mode is the shared ASYMSPEC_MODE, which the base class reads as well."""
    assert shadowed_fields(EdgeSettings) == {"colocated_mode"}
    assert shadowed_fields(CloudSettings) == set()
    assert "--colocated-mode" not in build_parser(EdgeSettings, "edge").format_help()


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYMSPEC_EDGE_SHARED_SECRET", "an-edge-secret")
    monkeypatch.setenv("ASYMSPEC_EDGE_PORT", "9000")
    monkeypatch.setenv("ASYMSPEC_EDGE_GOODPUT_PAUSE", "true")
    settings = parse_settings(
        EdgeSettings, "edge", ["--port", "9100", "--topk-steps", "4,8", "--no-goodput-pause"]
    )
    assert (settings.port, settings.topk_steps, settings.goodput_pause) == (9100, (4, 8), False)
    assert settings.shared_secret == "an-edge-secret"  # no flag: the environment's value
    assert parse_settings(EdgeSettings, "edge", []).port == 9000


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--no-such-flag", "1"], "--no-such-flag"),
        (["--port", "eighty"], "--port (ASYMSPEC_CLOUD_PORT)"),
        (["--engine", "vllm"], "--engine"),
        (["--max-batch-size", "0"], "--max-batch-size"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_CLOUD_SHARED_SECRET", "a-cloud-secret")
    with pytest.raises(SystemExit) as exited:
        parse_settings(CloudSettings, "python -m cloud_verifier", argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


def test_a_bad_environment_value_is_named_by_flag_and_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_EDGE_SHARED_SECRET", "an-edge-secret")
    monkeypatch.setenv("ASYMSPEC_MODE", "no-such-mode")
    with pytest.raises(SystemExit) as exited:
        parse_settings(EdgeSettings, "python -m edge_gateway", [])
    assert exited.value.code == 2
    assert "--mode (ASYMSPEC_MODE): " in capsys.readouterr().err


def run_module(service: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", service, *argv], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_help_through_a_real_process(service: str) -> None:
    done = run_module(service, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {service} [options]")
    for field in set(SERVICES[service].model_fields) - shadowed_fields(SERVICES[service]):
        assert flag_name(field) in done.stdout
        assert env_name(SERVICES[service], field) in done.stdout.replace("\n", "")


@pytest.mark.slow
def test_a_bad_flag_exits_2_through_a_real_process() -> None:
    done = run_module("edge_gateway", "--shared-secret", "an-edge-secret", "--prot", "8000")
    assert done.returncode == 2
    assert done.stderr == "python -m edge_gateway: error: unrecognized arguments: --prot 8000\n"
