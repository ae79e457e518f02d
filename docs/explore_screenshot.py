"""Take the README's screenshot of the explorer page (docs/explore.png) from a real run.

Builds a catalog of scikit-image's bundled photographs with the embedded backbone (the real
``vitembed embed-catalog`` and ``index build``), starts ``vitembed serve`` with that index on 127.0.0.1,
opens the page in headless Chromium (Debian's ``chromium``, driven by Playwright), loads a crop of one of
the photos, clicks a patch, and saves the page, reduced to 256 colours so that it stays small.

    python docs/explore_screenshot.py [--out docs/explore.png] [--photo chelsea] [--patch ROW COL]
"""

from __future__ import annotations

import argparse
import io
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image

PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "colorwheel",
)
HOST = "127.0.0.1"


def write_photos(folder: Path) -> dict[str, bytes]:
    from skimage import data

    folder.mkdir(parents=True)
    out = {}
    for name in PHOTOS:
        buffer = io.BytesIO()
        Image.fromarray(getattr(data, name)()).convert("RGB").save(buffer, "JPEG", quality=92)
        out[name] = buffer.getvalue()
        (folder / f"{name}.jpg").write_bytes(out[name])
    return out


def crop(data: bytes, keep: float) -> bytes:
    image = Image.open(io.BytesIO(data))
    w, h = image.size
    dx, dy = int(w * (1 - keep) / 2), int(h * (1 - keep) / 2)
    buffer = io.BytesIO()
    image.crop((dx, dy, w - dx, h - dy)).save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def vitembed(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "vitembed", *args], check=True)


def serve(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    log = (root / "serve.log").open("wb")
    command = [
        sys.executable, "-m", "vitembed", "serve", "--host", HOST, "--port", str(port),
        "--index", f"photos={root / 'db'}:photos",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vitembed serve exited: {(root / 'serve.log').read_text()}")
        try:
            if httpx.get(url + "/ready", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("vitembed serve was not ready within 120 s")


def shoot(url: str, query: bytes, patch: tuple[int, int], out: Path) -> None:
    from playwright.sync_api import FilePayload, sync_playwright

    with sync_playwright() as playwright:
        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)
        page.goto(url + "/explore")
        page.wait_for_function("() => document.body.dataset.ready === 'true'")
        page.set_input_files(
            "#file", files=[FilePayload(name="query.jpg", mimeType="image/jpeg", buffer=query)]
        )
        page.wait_for_function("() => Number(document.body.dataset.neighbours || 0) > 0")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.neighbour img')].every((i) => i.naturalWidth > 0)"
        )
        rows, cols = (int(v) for v in (page.get_attribute("#view", "data-grid") or "1x1").split("x"))
        box = page.locator("#view").bounding_box()
        assert box is not None
        row, col = patch
        page.mouse.click(
            box["x"] + (col + 0.5) * box["width"] / cols, box["y"] + (row + 0.5) * box["height"] / rows
        )
        page.wait_for_function(f"() => document.getElementById('match-heat').dataset.patch === '{row},{col}'")
        page.locator("#file").blur()
        shot = page.screenshot(full_page=True)
        browser.close()
    image = Image.open(io.BytesIO(shot)).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, optimize=True
    )
    print(f"{out}: {image.size[0]}x{image.size[1]}, {out.stat().st_size / 1024:.0f} KB")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("explore.png"))
    parser.add_argument("--photo", default="chelsea", choices=PHOTOS)
    parser.add_argument("--keep", type=float, default=0.8, help="the query is the photo's centre, this share")
    parser.add_argument("--patch", type=int, nargs=2, default=(5, 5), metavar=("ROW", "COL"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        photos = write_photos(root / "photos")
        vitembed("embed-catalog", str(root / "photos"), "--out", str(root / "cat"))
        vitembed("index", "build", str(root / "cat"), "--db", str(root / "db"), "--table", "photos")
        proc, url = serve(root)
        try:
            shoot(url, crop(photos[args.photo], args.keep), tuple(args.patch), args.out)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
