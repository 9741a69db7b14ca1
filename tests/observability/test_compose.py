"""compose.yaml, the Dockerfiles and the Prometheus/Grafana files, checked against each other
and against the services' settings, without a Docker engine (`make compose-check`, run by
CI after the tests, builds and runs the stack for real).

What `docker compose config` and a build would catch first, and what they would not: a
build context or COPY source that is missing or excluded by .dockerignore, a settings
variable that no settings field reads (pydantic-settings ignores unknown ones silently), a
Prometheus target that names no service or the wrong port, and a network layout that lets
anything but edge<->cloud traffic onto the shaped link.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from asymspec.links import PROFILES
from asymspec.modes import MODES
from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from cloud_verifier.settings import CloudSettings
from edge_gateway.settings import EdgeSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (ROOT / "compose.yaml", ROOT / "docker" / "compose.gpu.yaml")
APPS: dict[str, type[EdgeSettings] | type[CloudSettings]] = {
    "edge-gateway": EdgeSettings,
    "cloud-verifier": CloudSettings,
}
APP_PORTS = {"edge-gateway": 8000, "cloud-verifier": 8001}
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?([-?]))?([^}]*)\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILES[0].read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


# ---------------------------------------------------------------------------------------
# Helpers: compose values and Dockerfiles


def default_of(value: object) -> str | None:
    """What compose substitutes when the variables are unset: ``${X:-d}`` -> d, ``${X}`` ->
    '', literals as they are; None when a ``${X:?message}`` demands the variable."""
    required = False

    def substitute(match: re.Match[str]) -> str:
        nonlocal required
        _, kind, rest = match.groups()
        required = required or kind == "?"
        return rest if kind == "-" else ""

    text = _INTERPOLATION.sub(substitute, str(value))
    return None if required else text


def env_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {k: "" if v is None else str(v) for k, v in environment.items()}


def dockerfile_of(service: dict[str, Any]) -> Path:
    build = service["build"]
    return ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")


def instructions(dockerfile: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        if logical.strip():
            keyword, _, args = logical.strip().partition(" ")
            yield keyword.upper(), args.strip()
        logical = ""


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions(dockerfile):
        if keyword == "ENV":
            for key, _, value in (p.partition("=") for p in args.split() if "=" in p):
                env[key] = value
    return env


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for keyword, args in instructions(dockerfile):
        if keyword == "COPY" and "--from" not in args:
            sources += [part for part in args.split()[:-1] if not part.startswith("--")]
    return sources


def dockerignore_for(dockerfile: Path, context: Path) -> list[str]:
    """BuildKit's rule: <Dockerfile>.dockerignore beside the Dockerfile wins over the
    context's .dockerignore."""
    for candidate in (
        dockerfile.with_name(dockerfile.name + ".dockerignore"),
        context / ".dockerignore",
    ):
        if candidate.is_file():
            lines = candidate.read_text().splitlines()
            return [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return []


def sent_files(context: Path, source: str, patterns: list[str]) -> list[Path]:
    """The files under a COPY source that reach the build (a folder: those inside it)."""
    files = []
    for match in context.glob(source):
        files += [f for f in match.rglob("*") if f.is_file()] if match.is_dir() else [match]
    return [f for f in files if is_sent(str(f.relative_to(context)), patterns)]


def is_sent(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` reaches the build: the last matching pattern decides; a pattern
    that matches a folder matches everything below it (Docker's .dockerignore rules)."""
    sent = True
    parts = Path(path).parts
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        prefixes = ("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            sent = negated
    return sent


def healthcheck_of(service: dict[str, Any]) -> str:
    """The health test compose will run: the service's own, else its image's HEALTHCHECK."""
    own = service.get("healthcheck")
    if own:
        assert not own.get("disable"), "healthcheck disabled"
        return str(own["test"])
    if "build" not in service:
        return ""
    checks = [args for key, args in instructions(dockerfile_of(service)) if key == "HEALTHCHECK"]
    return checks[-1] if checks else ""


def networks_of(service: dict[str, Any]) -> set[str]:
    return set(service.get("networks") or [])  # a list, or a mapping of name -> options


def namespace_owner(name: str, services: dict[str, dict[str, Any]]) -> str:
    """The service whose network namespace ``name`` lives in (itself unless network_mode)."""
    mode = services[name].get("network_mode", "")
    return mode.removeprefix("service:") if mode.startswith("service:") else name


# ---------------------------------------------------------------------------------------
# Builds and mounts


def test_builds_and_copied_files_exist(services: dict[str, dict[str, Any]]) -> None:
    built = {name: s for name, s in services.items() if "build" in s}
    assert {"edge-gateway", "cloud-verifier", "netem-uplink", "locust"} <= set(built)
    for name, service in built.items():
        context = ROOT / service["build"].get("context", ".")
        dockerfile = dockerfile_of(service)
        assert dockerfile.is_file(), (name, dockerfile)
        ignore = dockerignore_for(dockerfile, context)
        for source in copy_sources(dockerfile):
            if source.rstrip("/") == "models":
                continue  # test_images_ship_the_committed_draft
            assert sent_files(context, source, ignore), f"{name}: COPY {source} sends nothing"


def test_images_ship_the_committed_draft() -> None:
    # The app images run `python -m asymspec_engine.prepare` at build time, which needs
    # the committed draft (models/smollm2-draft/, trained by scripts/distill_draft.py).
    patterns = dockerignore_for(ROOT / "docker/edge-gateway.Dockerfile", ROOT)
    needed = ("models/smollm2-draft/config.json", "models/smollm2-draft/model.safetensors")
    assert all(is_sent(path, patterns) for path in needed)
    if not all((ROOT / path).is_file() for path in needed):
        pytest.skip("the draft is not committed yet: building the app images would fail")


def test_dockerignore_rules() -> None:
    patterns = ["*", "!shared/", "**/__pycache__"]
    assert is_sent("shared/asymspec/links.py", patterns)
    assert not is_sent(".venv/bin/python", patterns)
    assert not is_sent("shared/asymspec/__pycache__", patterns)


def test_bind_mounts_exist_or_are_ignored_outputs(services: dict[str, dict[str, Any]]) -> None:
    ignored = [
        line.strip().strip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, _, rest = str(volume).partition(":")
            if not source.startswith((".", "/")):
                continue  # a named volume
            relative = source.removeprefix("./")
            if rest.endswith(":ro"):
                assert (ROOT / relative).exists(), f"{name} mounts missing {source}"
            else:  # written by the container: an output folder git must ignore
                assert any(fnmatch.fnmatch(relative, p) for p in ignored), (name, source)


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = str(volume).partition(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], source
    assert "/models" in [
        str(v).partition(":")[2] for v in compose["services"]["edge-gateway"]["volumes"]
    ]


# ---------------------------------------------------------------------------------------
# Health and start-up order


def test_every_awaited_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name in APPS:
        assert "/health" in healthcheck_of(services[name]), name
    for name, service in services.items():
        for dependency, rule in (service.get("depends_on") or {}).items():
            assert dependency in services, (name, dependency)
            if rule["condition"] == "service_healthy":
                target = services[dependency]
                check = healthcheck_of(target)
                if not check and "build" in target:
                    pytest.fail(f"{name} waits for {dependency}, which has no healthcheck")
                assert check, (name, dependency)


def test_edge_waits_for_the_cloud_and_locust_for_the_link(
    services: dict[str, dict[str, Any]],
) -> None:
    assert services["edge-gateway"]["depends_on"]["cloud-verifier"]["condition"] == (
        "service_healthy"
    )
    locust = services["locust"]
    assert locust["profiles"] == ["load"]
    awaited = {name for name, rule in locust["depends_on"].items()}
    assert awaited == {"edge-gateway", "netem-uplink", "netem-downlink"}
    assert all(rule["condition"] == "service_healthy" for rule in locust["depends_on"].values())


# ---------------------------------------------------------------------------------------
# Settings


def app_environment(name: str) -> dict[str, str]:
    """Every variable an app container gets from its image and from any compose file."""
    env: dict[str, str] = {}
    for path in COMPOSE_FILES:
        service = yaml.safe_load(path.read_text())["services"].get(name, {})
        env |= env_of(service)
    base = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"][name]
    return dockerfile_env(dockerfile_of(base)) | env


def settings_names(settings: type[Any]) -> set[str]:
    """The environment names a pydantic-settings model reads: prefix + field, and aliases."""
    prefix = settings.model_config["env_prefix"]
    names = set()
    for field_name, info in settings.model_fields.items():
        names.add(f"{prefix}{field_name}".upper())
        alias = info.validation_alias
        for choice in getattr(alias, "choices", [alias] if alias else []):
            names.add(str(choice).upper())
    return names


@pytest.mark.parametrize("name", sorted(APPS))
def test_app_variables_are_settings_fields(name: str) -> None:
    settings = APPS[name]
    known = settings_names(settings)
    prefix = settings.model_config["env_prefix"]
    env = app_environment(name)
    for variable in env:
        if variable.startswith(prefix) or variable == "ASYMSPEC_MODE":
            assert variable in known, f"{name}: {variable} is not a {settings.__name__} field"
    defaults = {
        k.removeprefix(prefix).lower(): default_of(v)
        for k, v in env.items()
        if k.startswith(prefix)
    }
    # Unset ('') leaves a field at its default; a required one (None) gets a stand-in.
    given = {k: "stand-in-for-required" if v is None else v for k, v in defaults.items() if v != ""}
    parsed = settings.model_validate(given)
    assert parsed.host == "0.0.0.0", "bind all interfaces inside the container"
    assert parsed.port == APP_PORTS[name]


def test_defaults_are_valid_choices(services: dict[str, dict[str, Any]]) -> None:
    edge, cloud = env_of(services["edge-gateway"]), env_of(services["cloud-verifier"])
    assert default_of(edge["ASYMSPEC_MODE"]) in MODES
    assert default_of(edge["ASYMSPEC_EDGE_DRAFT_MODEL"]) == EMBEDDED_DRAFT
    assert default_of(cloud["ASYMSPEC_CLOUD_TARGET_MODEL"]) == EMBEDDED_TARGET
    for sidecar in ("netem-uplink", "netem-downlink"):
        assert default_of(env_of(services[sidecar])["LINK_PROFILE"]) in PROFILES


def test_the_shared_secret_is_demanded(services: dict[str, dict[str, Any]]) -> None:
    for name, settings in APPS.items():
        value = env_of(services[name])[f"{settings.model_config['env_prefix']}SHARED_SECRET"]
        assert value.startswith("${ASYMSPEC_SHARED_SECRET:?"), (name, value)
        assert default_of(value) is None


def test_edge_dials_the_cloud_service(services: dict[str, dict[str, Any]]) -> None:
    url = env_of(services["edge-gateway"])["ASYMSPEC_EDGE_CLOUD_URL"]
    assert url == f"wss://cloud-verifier:{APP_PORTS['cloud-verifier']}/v1/channel"


def test_the_channel_uses_mutual_tls_from_the_init_service(
    services: dict[str, dict[str, Any]],
) -> None:
    edge, cloud = env_of(services["edge-gateway"]), env_of(services["cloud-verifier"])
    assert cloud["ASYMSPEC_CLOUD_SSL_CA_CERTS"] == edge["ASYMSPEC_EDGE_CLOUD_CA_CERTS"]
    for path in (
        cloud["ASYMSPEC_CLOUD_SSL_CERTFILE"],
        cloud["ASYMSPEC_CLOUD_SSL_KEYFILE"],
        edge["ASYMSPEC_EDGE_CLOUD_CERTFILE"],
        edge["ASYMSPEC_EDGE_CLOUD_KEYFILE"],
    ):
        assert path.startswith("/certs/"), path
    init = services["certificates"]
    assert "asymspec.certificates /certs" in " ".join(init["command"])
    assert "cloud-verifier" in " ".join(init["command"])  # the name the edge verifies
    for name in ("cloud-verifier", "edge-gateway"):
        assert "certs:/certs:ro" in services[name]["volumes"]
    condition = services["cloud-verifier"]["depends_on"]["certificates"]["condition"]
    assert condition == "service_completed_successfully"


def test_published_ports(services: dict[str, dict[str, Any]]) -> None:
    def published(name: str) -> dict[int, int]:
        """container port -> host port (defaults substituted)."""
        ports = {}
        for spec in services[name].get("ports", []):
            *host, container = str(default_of(spec)).rsplit(":", 2)
            ports[int(container)] = int(host[-1])
        return ports

    assert published("edge-gateway")[8000] == 8000
    assert published("grafana")[3000] == 3000
    assert published("prometheus")[9090] == 9090
    # The sidecars' control ports live on the services whose namespace they share.
    assert published("edge-gateway")[9100] == 9100
    assert published("cloud-verifier")[9100] == 9101


# ---------------------------------------------------------------------------------------
# Networks and scraping


def test_wan_carries_only_edge_and_cloud(compose: dict[str, Any]) -> None:
    services = compose["services"]
    on_wan = {name for name, s in services.items() if "wan" in networks_of(s)}
    assert on_wan == {"edge-gateway", "cloud-verifier"}
    assert compose["networks"]["wan"].get("internal") is True
    # Sharing only wan, the edge resolves cloud-verifier to its wan address: the channel
    # cannot take an unshaped path.
    assert networks_of(services["edge-gateway"]) & networks_of(services["cloud-verifier"]) == {
        "wan"
    }
    peers = {"netem-uplink": ("edge-gateway", "UPLINK_PEER", "cloud-verifier")}
    peers["netem-downlink"] = ("cloud-verifier", "DOWNLINK_PEER", "edge-gateway")
    for sidecar, (owner, variable, peer) in peers.items():
        service = services[sidecar]
        assert service["network_mode"] == f"service:{owner}"
        assert service["cap_add"] == ["NET_ADMIN"]
        assert env_of(service)[variable] == peer


def test_prometheus_scrapes_every_service_off_the_wan(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load((ROOT / "observability/prometheus/prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    sidecar_port = int(dockerfile_env(ROOT / "netem/Dockerfile")["CONTROL_PORT"])
    ports = {**APP_PORTS, "netem-uplink": sidecar_port, "netem-downlink": sidecar_port}
    jobs = {}
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        (target,) = static["targets"]
        jobs[job["job_name"]] = target
    assert set(jobs) == set(ports), "one job per service with metrics, named after it"
    prometheus_networks = networks_of(services["prometheus"])
    assert "wan" not in prometheus_networks
    for job, target in jobs.items():
        host, port = target.rsplit(":", 1)
        owner = namespace_owner(job, services)
        assert host == owner, f"{job}: scrape {owner}, whose namespace it is in"
        assert int(port) == ports[job], job
        assert prometheus_networks & networks_of(services[owner]), f"no network to {owner}"


def test_grafana_provisioning_is_mounted(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, *_ = str(volume).split(":")
        mounts[source.removeprefix("./")] = target
    provider = yaml.safe_load(
        (ROOT / "observability/grafana/provisioning/dashboards/asymspec.yaml").read_text()
    )["providers"][0]
    assert mounts["observability/grafana/dashboards"] == provider["options"]["path"]
    home = env_of(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    relative = Path(home).relative_to(provider["options"]["path"])
    assert (ROOT / "observability/grafana/dashboards" / relative).is_file()
    (datasource,) = yaml.safe_load(
        (ROOT / "observability/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    assert networks_of(grafana) & networks_of(services["prometheus"])


def test_gpu_override_extends_known_services(services: dict[str, dict[str, Any]]) -> None:
    override = yaml.safe_load(COMPOSE_FILES[1].read_text())["services"]
    assert set(override) <= set(services)
    for name, service in override.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
        assert "TORCH_INDEX_URL" in service["build"]["args"]
