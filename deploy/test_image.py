"""Build the CPU image with podman and run it for real (called once by .ci/run; needs root and apt-get).

    python deploy/test_image.py            # prints each phase's time, the image size per layer, time to ready

1. podman, runc, debootstrap from Debian (apt-get) when missing; storage in /var/tmp/vitembed-podman (never
   in the repository). No registry is reachable: a local Debian 12 rootfs (debootstrap) with Python 3.11 is
   tagged as the public ``python:3.11-slim`` the Dockerfile names, once, and reused by later runs.
2. ``podman build --format docker``: the host's CA bundle and its pip find-links folders (torch's CPU wheel)
   are lent to the build with ``-v`` and a pip.conf; the Dockerfile knows nothing of this machine.
3. ``podman inspect``: healthcheck on /health, non-root user, exec-form entry point; inside: no CUDA in torch,
   no nvidia-* distribution, the weights' licence and the SBOM present.
4. ``--network none --read-only --tmpfs /tmp --cpus 1``: ready from inside (podman exec), an embedding served
   offline, torch at 1 thread, the HEALTHCHECK command passes.
5. bridge network, published 127.0.0.1 port: a JPEG over HTTP against the library on this machine (same file,
   same options, --precision float32; max abs difference of normalised vectors <= 1e-5), a body over 1 MB
   (spooled to the tmpfs under a read-only root), then SIGTERM (podman stop -t 60 > the 30 s drain) during a
   burst: every request the server accepted is answered, exit status 0.
6. ``podman-compose up`` of deploy/compose.yaml's default profile serves; ``down -v`` after.
Exit status 0 when every check passed, 1 otherwise (each failure is printed), 0 with "SKIP" where podman
cannot run (not root, no apt-get).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import configparser
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("VITEMBED_PODMAN_STATE", "/var/tmp/vitembed-podman"))
IMAGE = "localhost/vitembed:0.1.0-cpu"
PYTHON_IMAGE = "localhost/python:3.11-slim"  # the local stand-in, given to the build as PYTHON_IMAGE
DEBIAN_IMAGE = "localhost/local/debian:bookworm"
SIZE_LIMIT = 2_000_000_000
DRAIN_S = 30
STARTED = time.monotonic()
FAILURES: list[str] = []

CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {message}", flush=True)


def check(ok: bool, what: str) -> None:
    say(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def podman_base() -> list[str]:
    return ["podman", "--root", str(STATE / "root"), "--runroot", str(STATE / "runroot")]


def podman(
    *args: str, check_rc: bool = True, timeout: float = 600, **kw: Any
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*podman_base(), *args], capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if check_rc and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


# ----------------------------------------------------------------------------------------------- setup
def install_tools() -> None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if not missing:
        return
    say(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True, timeout=300)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "podman", "runc", "debootstrap"],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )


def debian_mirror() -> str:
    """The Debian mirror of this machine's apt sources (deb822 or one-line form)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    sources = Path("/etc/apt/sources.list")
    if sources.is_file():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if parts[:1] == ["deb"] and "security" not in line:
                return next(p for p in parts[1:] if p.startswith("http"))
    raise RuntimeError("debootstrap needs a Debian mirror: none in /etc/apt/sources.list(.d)")


def ensure_base_image() -> None:
    """The stand-in for python:3.11-slim (built once; later runs reuse it from the podman storage)."""
    if podman("image", "exists", PYTHON_IMAGE, check_rc=False).returncode == 0:
        say(f"base image {PYTHON_IMAGE} (local stand-in) already built")
        return
    if podman("image", "exists", DEBIAN_IMAGE, check_rc=False).returncode != 0:
        rootfs = STATE / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        mirror = debian_mirror()
        say(f"debootstrap bookworm from {mirror}")
        subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
            check=True,
            capture_output=True,
            timeout=900,
        )
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        for sources in Path("/etc/apt/sources.list.d").glob("*.sources"):  # apt inside builds: the host's
            shutil.copy(sources, rootfs / "etc/apt/sources.list.d" / sources.name)
        if list(Path("/etc/apt/sources.list.d").glob("*.sources")):
            (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        podman("import", "-", DEBIAN_IMAGE, stdin=tar.stdout)
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
    say("building the Python 3.11 base image")
    podman(
        "build", "-q", "-t", PYTHON_IMAGE, "-f", str(ROOT / "deploy/testing/python-base.Dockerfile"),
        str(ROOT / "deploy/testing"),
    )  # fmt: skip


def pip_settings() -> tuple[str, list[str]]:
    """(CA bundle, local find-links folders) of this machine's pip configuration."""
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or ""
    links = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".cert") and not cert:
            cert = value
        elif key.endswith(".find-links"):
            links += value.split()
    cert = cert or "/etc/ssl/certs/ca-certificates.crt"
    folders = sorted(
        {link.removeprefix("file://") for link in links if Path(link.removeprefix("file://")).is_dir()}
    )
    return cert, folders


def build_image() -> None:
    cert, folders = pip_settings()
    lend = STATE / "lend"
    lend.mkdir(parents=True, exist_ok=True)
    pip_conf = configparser.ConfigParser()
    pip_conf["global"] = {"timeout": "180"}
    volumes: list[str] = []
    if Path(cert).is_file():
        pip_conf["global"]["cert"] = "/run/host/ca.crt"
        volumes += ["-v", f"{cert}:/run/host/ca.crt:ro"]
    mounted = [f"/run/host/wheels{i}" for i in range(len(folders))]
    for folder, target in zip(folders, mounted, strict=True):
        volumes += ["-v", f"{folder}:{target}:ro"]
    if mounted:
        pip_conf["global"]["find-links"] = "\n".join(mounted)
    with (lend / "pip.conf").open("w") as handle:
        pip_conf.write(handle)
    volumes += ["-v", f"{lend / 'pip.conf'}:/etc/pip.conf:ro"]
    say(f"podman build (lent: CA bundle, pip.conf, find-links {folders})")
    started = time.monotonic()
    done = podman(
        "build",
        "--format",
        "docker",
        "--layers",
        "-t",
        IMAGE,
        "--build-arg",
        f"PYTHON_IMAGE={PYTHON_IMAGE}",
        *volumes,
        str(ROOT),
        check_rc=False,
        timeout=1200,
    )
    (STATE / "build.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"podman build failed; the log's end:\n{(done.stdout + done.stderr)[-3000:]}")
    say(f"image built in {time.monotonic() - started:.0f} s (log: {STATE / 'build.log'})")


# ------------------------------------------------------------------------------------------- checks
def inspect_image() -> None:
    (info,) = json.loads(podman("image", "inspect", IMAGE).stdout)
    config = info["Config"]
    health = (info.get("Healthcheck") or config.get("Healthcheck") or {}).get("Test") or []
    check(health[:1] == ["CMD"] and "/health" in " ".join(health), f"HEALTHCHECK on /health: {health}")
    user = config.get("User", "")
    check(bool(user) and user.split(":")[0] not in {"0", "root"}, f"runs as a non-root user: {user!r}")
    entry = config.get("Entrypoint")
    check(entry == ["vitembed", "serve", "--host", "0.0.0.0"], f"exec-form entry point: {entry}")
    size = int(info["Size"])
    check(size <= SIZE_LIMIT, f"image size {size / 1e9:.2f} GB <= {SIZE_LIMIT / 1e9:.1f} GB")
    say("layers (size, instruction):")
    for line in podman(
        "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", IMAGE
    ).stdout.splitlines():
        size_text, _, created = line.partition("\t")
        if not size_text.startswith("0"):
            print(f"    {size_text:>10}  {created[:110]}")
    probe = (
        "import importlib.metadata as m, json, os, torch; "
        "print(json.dumps({'cuda': torch.version.cuda, "
        "'nvidia': sorted(d.metadata['Name'] for d in m.distributions() "
        "if d.metadata['Name'].lower().startswith(('nvidia', 'triton', 'cuda'))), "
        "'sbom': json.load(open('/opt/vitembed/sbom.cdx.json'))['bomFormat'], "
        "'components': len(json.load(open('/opt/vitembed/sbom.cdx.json'))['components']), "
        "'licences': sorted(os.listdir('/opt/vitembed/licenses'))}))"
    )
    facts = json.loads(
        podman("run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c", probe).stdout
    )
    check(facts["cuda"] is None, f"torch.version.cuda is None in the CPU image ({facts['cuda']!r})")
    check(facts["nvidia"] == [], f"no nvidia-*/cuda-*/triton distribution inside ({facts['nvidia']})")
    dpkg = podman(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "sh",
        IMAGE,
        "-c",
        "dpkg -l | grep -ci nvidia || true",
    )
    check(dpkg.stdout.strip() == "0", "no nvidia Debian package inside")
    check(
        facts["sbom"] == "CycloneDX"
        and facts["components"] > 40
        and "embedded-weights.md" in facts["licences"],
        f"SBOM ({facts['sbom']}, {facts['components']} components) and weights licence {facts['licences']}",
    )


def _jpeg(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 127 // (width + height)], -1)
    pixels = np.clip(base + rng.integers(0, 48, size=(height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


_EXEC_READY = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)"
_EXEC_EMBED = """
import base64, io, json, urllib.request
from PIL import Image
buf = io.BytesIO(); Image.new("RGB", (320, 240), (180, 40, 90)).save(buf, "JPEG")
body = json.dumps({"images": [{"base64": base64.b64encode(buf.getvalue()).decode()}], "normalize": True})
req = urllib.request.Request("http://127.0.0.1:8000/v1/embed", data=body.encode(),
                             headers={"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=60))
vector = out["data"][0]["embedding"]
print(json.dumps({"dim": out["dim"], "n": len(vector), "precision": out["provenance"]["precision"]}))
"""
_EXEC_THREADS = "from vit_backbone.cpu_quota import available_cpus; print(available_cpus())"


def offline_run() -> float:
    name = "vitembed-test-offline"
    podman("rm", "-f", name, check_rc=False)
    started = time.monotonic()
    podman(
        "run", "-d", "--name", name, "--network", "none", "--read-only", "--tmpfs", "/tmp", "--cpus", "1",
        IMAGE, "--precision", "float32",
    )  # fmt: skip
    try:
        ready = None
        while time.monotonic() - started < 300:
            if podman("exec", name, "python", "-c", _EXEC_READY, check_rc=False).returncode == 0:
                ready = time.monotonic() - started
                break
            if (
                podman("inspect", "--format", "{{.State.Running}}", name, check_rc=False).stdout.strip()
                != "true"
            ):
                break
            time.sleep(0.5)
        check(ready is not None, f"offline container ready (--network none --read-only --cpus 1): {ready} s")
        if ready is None:
            print(podman("logs", name, check_rc=False).stderr[-3000:])
            return float("nan")
        out = json.loads(podman("exec", name, "python", "-c", _EXEC_EMBED).stdout)
        check(out == {"dim": 768, "n": 768, "precision": "float32"}, f"offline embedding served: {out}")
        threads = podman("exec", name, "python", "-c", _EXEC_THREADS).stdout.strip()
        logs = podman("logs", name).stderr + podman("logs", name).stdout
        check(
            threads == "1" and "torch threads: 1" in logs, f"--cpus 1 -> torch threads 1 (cgroup: {threads})"
        )
        # the image carries uvicorn's httptools protocol (the head gate: 429 on the request head, the head
        # timeout) and uvloop with the server's own accept loop, as the overload bench measured them
        check(
            "httptools is not installed" not in logs and "the server's own accept loop on uvloop" in logs,
            "the server runs the head gate (httptools) and its accept loop (uvloop)",
        )
        health = podman("healthcheck", "run", name, check_rc=False)
        check(health.returncode == 0, f"HEALTHCHECK command passes ({health.stdout.strip() or 'healthy'})")
        return ready
    finally:
        podman("rm", "-f", "-t", "5", name, check_rc=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, timeout: float = 300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout} s")


def bridge_run() -> None:
    import httpx
    import numpy as np

    from vit_backbone import load_backbone

    name = "vitembed-test-bridge"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    podman("rm", "-f", name, check_rc=False)
    podman(
        "run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp", "-p", f"127.0.0.1:{port}:8000",
        IMAGE, "--precision", "float32", "--queue-delay-target-s", "30",  # admit the whole burst below
    )  # fmt: skip
    try:
        say(f"bridge container ready after {_wait_ready(url):.1f} s (published on {url})")
        photo = _jpeg(640, 480, seed=7)
        answer = httpx.post(
            url + "/v1/embed",
            files={"image": ("photo.jpg", photo, "image/jpeg")},
            data={"normalize": "true"},
            timeout=60,
        )
        check(answer.status_code == 200, f"POST /v1/embed over the published port: {answer.status_code}")
        served = np.asarray(answer.json()["data"][0]["embedding"], dtype=np.float32)
        library = load_backbone("embedded").embed([photo], normalize=True)[0]  # float32, the model's defaults
        diff = float(np.abs(served - library).max())
        check(
            diff <= 1e-5, f"server vs library (same JPEG, defaults, float32): max abs diff {diff:.2e} <= 1e-5"
        )
        big = _jpeg(1800, 1400, seed=3, quality=98)  # > 1 MB: multipart spools it to /tmp (the tmpfs)
        spooled = httpx.post(url + "/v1/embed", files={"image": ("big.jpg", big, "image/jpeg")}, timeout=120)
        check(
            spooled.status_code == 200,
            f"a {len(big) / 1e6:.1f} MB upload under a read-only root: {spooled.status_code}",
        )
        drain_under_burst(name, url)
    finally:
        podman("rm", "-f", "-t", "5", name, check_rc=False)


def drain_under_burst(name: str, url: str) -> None:
    """SIGTERM while 8 clients keep posting: every request the server accepted gets its answer."""
    import httpx

    photo = _jpeg(320, 240, seed=11)
    outcomes: list[str] = []
    spans: list[tuple[float, float]] = []  # (start, end) of each answered request
    lock = threading.Lock()
    first_answers = threading.Event()
    stop_sent = threading.Event()

    def client() -> None:
        while True:
            begun = time.monotonic()
            try:  # a new connection per request: "accepted" means this request's connection was accepted
                response = httpx.post(
                    url + "/v1/embed",
                    files={"image": ("p.jpg", photo, "image/jpeg")},
                    headers={"Connection": "close"},
                    timeout=90,
                )
                outcome = f"http {response.status_code}"
            except httpx.ConnectError:
                outcome = "refused"  # never accepted: the server had stopped listening
            except httpx.HTTPError as exc:
                outcome = f"broken {type(exc).__name__}"
            with lock:
                outcomes.append(outcome)
                if outcome.startswith("http"):
                    spans.append((begun, time.monotonic()))
                if len(outcomes) >= 8:
                    first_answers.set()
            if outcome == "refused" or (stop_sent.is_set() and len(outcomes) > 400):
                return

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client) for _ in range(8)]
        first_answers.wait(120)
        time.sleep(0.3)
        say(f"SIGTERM (podman stop -t 60) during the burst, after {len(outcomes)} answers")
        stop_sent.set()
        sigterm_at = time.monotonic()
        stopped = podman("stop", "-t", "60", name, check_rc=False, timeout=120)
        for future in futures:
            future.result(timeout=180)
    exit_code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    counts = {kind: outcomes.count(kind) for kind in sorted(set(outcomes))}
    answered = sum(n for kind, n in counts.items() if kind.startswith("http"))
    in_flight = sum(1 for begun, ended in spans if begun < sigterm_at < ended)
    check(stopped.returncode == 0 and exit_code == "0", f"drained and exited with status {exit_code}")
    check(in_flight > 0, f"{in_flight} request(s) in flight at SIGTERM were answered during the drain")
    check(
        not any(kind.startswith("broken") or kind.startswith("http 5") for kind in counts),
        f"every accepted request answered during the drain: {counts} ({answered} answered)",
    )


def compose_run() -> None:
    compose = shutil.which("podman-compose")
    if compose is None:
        check(False, "podman-compose is installed (pip install podman-compose; part of the dev extra)")
        return
    port = _free_port()
    env = {**os.environ, "VITEMBED_HOST_PORT": str(port), "CONTAINERS_CONF": str(STATE / "containers.conf")}
    base = [compose, "--podman-args", " ".join(podman_base()[1:]), "-f", str(ROOT / "deploy/compose.yaml")]
    try:
        up = subprocess.run(
            [*base, "up", "-d", "--no-build"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        if up.returncode != 0:
            check(False, f"podman-compose up: {(up.stdout + up.stderr)[-1500:]}")
            return
        ready = _wait_ready(f"http://127.0.0.1:{port}")
        answer = urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        models = json.load(answer)
        check(
            answer.status == 200 and bool(models),
            f"podman-compose up (default profile) serves, ready in {ready:.1f} s",
        )
    finally:
        subprocess.run(
            [*base, "down", "-v", "-t", "40"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-build", action="store_true", help=f"reuse {IMAGE} from an earlier run")
    args = parser.parse_args()
    if os.geteuid() != 0 or (shutil.which("apt-get") is None and shutil.which("podman") is None):
        print("SKIP deploy/test_image.py: needs root and apt-get (or podman) to build and run the image")
        return 0
    install_tools()
    (STATE / "root").mkdir(parents=True, exist_ok=True)
    (STATE / "containers.conf").write_text(CONTAINERS_CONF)
    os.environ["CONTAINERS_CONF"] = str(STATE / "containers.conf")
    phases: dict[str, float] = {}
    mark = time.monotonic()
    ensure_base_image()
    phases["base image"] = time.monotonic() - mark
    mark = time.monotonic()
    if not args.skip_build:
        build_image()
    phases["image build"] = time.monotonic() - mark
    for phase, run in (
        ("inspect", inspect_image),
        ("offline run", offline_run),
        ("bridge run + drain", bridge_run),
        ("compose", compose_run),
    ):
        mark = time.monotonic()
        try:
            result = run()
            if phase == "offline run":
                say(f"time to ready (podman run -> /ready 200, --cpus 1): {result:.1f} s")
        except Exception as exc:  # one phase's crash is a failure of that phase; the others still run
            check(False, f"{phase}: {type(exc).__name__}: {exc}")
        phases[phase] = time.monotonic() - mark
    total = time.monotonic() - STARTED
    say("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + f"; total {total:.0f} s")
    if FAILURES:
        print(f"deploy/test_image.py: {len(FAILURES)} check(s) failed:", *FAILURES, sep="\n  ")
        return 1
    print(f"deploy/test_image.py: all checks passed in {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
