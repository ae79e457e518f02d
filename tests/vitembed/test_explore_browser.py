"""The explorer page in real headless Chromium (Debian's ``chromium``, driven by Playwright) against a real
``vitembed serve`` process on 127.0.0.1 with a LanceDB index of scikit-image's bundled photographs (built by
the real ``embed-catalog`` and ``index build``) and two frozen heads (a linear classifier and a patch head).

What a person sees is checked against what the API answers for the same image and options: the PCA
canvas's pixels against ``/v1/patch-features`` (and that against numpy on the library's tokens), the first
neighbour of a crop, the heat map's maximum after a click, the grid after a policy change, the server's
error message verbatim, the heads' predictions. Every page's network log holds only this server's origin;
axe-core finds no serious or critical violation; Tab / Shift+Tab reach every control and Space / Enter
operate them; with ``VITEMBED_API_KEY`` the page asks for the key and the thumbnails still render.

Screenshots go to ``$VITEMBED_TEST_ARTIFACTS`` (default: a pytest temp folder), printed at the end.
The module skips only when Chromium or the Playwright / axe-core packages are absent.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from heads_synthetic import CLASSES, labelled_image, make_labelled_folder, make_segmentation_folder
from PIL import Image
from test_server_process import ServerProcess, start_server
from vitembed.cli.main import main

from vit_backbone import Backbone
from vit_backbone.heads import TrainOptions, save_head, train_head

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Error, FileChooser, Page, Request, Response

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(
        "Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does it as root)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the Playwright package is not installed (pip install -e '.[dev]')"
)
axe_playwright = pytest.importorskip(
    "axe_playwright_python.sync_playwright",
    reason="axe-playwright-python (axe-core) is not installed (pip install -e '.[dev]')",
)

pytestmark = pytest.mark.slow
PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "colorwheel",
)
API_KEY = "explorer-test-key"
WAIT_MS = 30_000


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    from skimage import data

    out = {}
    for name in PHOTOS:
        buffer = io.BytesIO()
        Image.fromarray(getattr(data, name)()).convert("RGB").save(buffer, "JPEG", quality=90)
        out[name] = buffer.getvalue()
    return out


def jpeg_crop(data: bytes, keep: float) -> bytes:
    image = Image.open(io.BytesIO(data))
    w, h = image.size
    dx, dy = int(w * (1 - keep) / 2), int(h * (1 - keep) / 2)
    buffer = io.BytesIO()
    image.crop((dx, dy, w - dx, h - dy)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def flags(
    photos: dict[str, bytes], reference: Backbone, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[str]:
    """``--index`` and ``--head`` flags: the photos embedded and indexed by the real commands (ids = file
    names), a linear head on coloured shapes and a patch head on segmented shapes."""
    root = tmp_path_factory.mktemp("explore_browser")
    folder = root / "photos"
    folder.mkdir()
    for name, data in photos.items():
        (folder / f"{name}.jpg").write_bytes(data)
    model = ["--model", f"tiny={tiny_path}", "--precision", "float32"]
    assert main(["embed-catalog", str(folder), "--out", str(root / "cat"), *model]) == 0
    assert main(["index", "build", str(root / "cat"), "--db", str(root / "db"), "--table", "photos"]) == 0
    shapes = make_labelled_folder(root / "shapes", per_class=8)
    seg = make_segmentation_folder(root / "seg", count=12)
    for name, folder, options in (
        ("shapes", shapes, TrainOptions(kind="linear", pooling="mean", layers=(0, 1))),
        ("regions", seg, TrainOptions(kind="patch", size=(112, 112))),
    ):
        save_head(train_head(reference, folder, options).head, root / f"{name}.safetensors")
    return [
        "--index", f"photos={root / 'db'}:photos",
        "--head", f"shapes={root / 'shapes.safetensors'}",
        "--head", f"regions={root / 'regions.safetensors'}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(
    tiny_path: Path, flags: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    started = start_server(tiny_path, tmp_path_factory.mktemp("serve_explore"), *flags)
    yield started
    assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def keyed_server(
    tiny_path: Path, flags: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    started = start_server(
        tiny_path, tmp_path_factory.mktemp("serve_keyed"), *flags, env={"VITEMBED_API_KEY": API_KEY}
    )
    yield started
    assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = Path(os.environ.get("VITEMBED_TEST_ARTIFACTS") or tmp_path_factory.mktemp("explore_artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    print(f"\nexplorer screenshots: {folder}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@dataclass
class Tab:
    """One page of a fresh browser context, with every request it made and every console error."""

    page: Page
    origin: str
    requests: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # answers >= 400 the page received

    def record_request(self, request: Request) -> None:
        self.requests.append(request)

    def record_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def record_page_error(self, error: Error) -> None:
        self.errors.append(str(error))

    def record_response(self, response: Response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.status} {response.url}")

    def foreign(self) -> list[str]:
        same = (self.origin + "/", "blob:" + self.origin + "/")
        return [r.url for r in self.requests if not r.url.startswith(same)]


@pytest.fixture
def open_tab(
    browser: Browser, artifacts: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[ServerProcess], Tab]]:
    tabs: list[Tab] = []

    def open_(server: ServerProcess) -> Tab:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        tab = Tab(context.new_page(), server.url)
        tab.page.set_default_timeout(WAIT_MS)
        tab.page.on("request", tab.record_request)
        tab.page.on("console", tab.record_console)
        tab.page.on("pageerror", tab.record_page_error)
        tab.page.on("response", tab.record_response)
        tab.page.goto(server.url + "/")
        tabs.append(tab)
        return tab

    yield open_
    for i, tab in enumerate(tabs):
        tab.page.screenshot(path=str(artifacts / f"{request.node.name}-{i}.png"), full_page=True)
        tab.page.context.close()
        # nothing on the page loads from anywhere but this server, whatever the test did
        assert tab.foreign() == [], tab.foreign()


# ------------------------------------------------------------------------------------------- helpers
def ready(tab: Tab) -> None:
    tab.page.wait_for_function("() => document.body.dataset.ready === 'true'")


def upload(tab: Tab, name: str, data: bytes, mime: str = "image/jpeg") -> None:
    """Pick a file through the page's own file input and wait until its patch features are drawn."""
    before = tab.page.evaluate("Number(document.body.dataset.features || 0)")
    tab.page.set_input_files("#file", files=[sync_api.FilePayload(name=name, mimeType=mime, buffer=data)])
    tab.page.wait_for_function(f"() => Number(document.body.dataset.features || 0) > {before}")


def canvas_rgb(tab: Tab, selector: str) -> np.ndarray:
    """The canvas's own pixels (not the scaled-up display), [height, width, 3] uint8."""
    found = tab.page.eval_on_selector(
        selector,
        "c => ({w: c.width, h: c.height, "
        "d: Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)})",
    )
    return np.asarray(found["d"], dtype=np.uint8).reshape(found["h"], found["w"], 4)[..., :3]


def form_options(tab: Tab) -> dict[str, str]:
    return tab.page.evaluate(
        "() => Object.fromEntries(['model', 'layer', 'policy', 'size-h', 'size-w']"
        ".map((id) => [id, document.getElementById(id).value]))"
    )


def api_options(options: dict[str, str]) -> dict[str, str]:
    """The page's form as the API's fields (what explore.js sends)."""
    out = {k: options[k] for k in ("model", "layer", "policy")}
    if options["size-h"] or options["size-w"]:
        out["size"] = f"{options['size-h'] or options['size-w']},{options['size-w'] or options['size-h']}"
    return out


def numpy_pca(tokens: np.ndarray) -> np.ndarray:
    """DINOv2's picture written out: centre, SVD, orient each direction by its largest loading, min-max."""
    h, w, d = tokens.shape
    x = tokens.reshape(-1, d).astype(np.float64)
    centred = x - x.mean(0)
    vt = np.linalg.svd(centred, full_matrices=False)[2][:3]
    vt = vt * np.sign(vt[np.arange(3), np.argmax(np.abs(vt), axis=1)])[:, None]
    p = centred @ vt.T
    return ((p - p.min(0)) / (p.max(0) - p.min(0))).reshape(h, w, 3)


def neighbour_ids(tab: Tab) -> list[str]:
    tab.page.wait_for_function("() => Number(document.body.dataset.neighbours || 0) > 0")
    return tab.page.eval_on_selector_all(".neighbour", "bs => bs.map((b) => b.dataset.id)")


def wait_for_thumbnails(tab: Tab) -> list[str]:
    """Every neighbour's <img> decoded from a blob: URL (fetched with the page's own credentials)."""
    tab.page.wait_for_function(
        "() => [...document.querySelectorAll('.neighbour img')]"
        ".every((i) => i.complete && i.naturalWidth > 0)"
    )
    return tab.page.eval_on_selector_all(".neighbour img", "is => is.map((i) => i.src)")


def click_patch(tab: Tab, row: int, col: int) -> None:
    grid = [int(v) for v in (tab.page.get_attribute("#view", "data-grid") or "").split("x")]
    box = tab.page.locator("#view").bounding_box()
    assert box is not None
    tab.page.mouse.click(
        box["x"] + (col + 0.5) * box["width"] / grid[1], box["y"] + (row + 0.5) * box["height"] / grid[0]
    )


# ------------------------------------------------------------------------------------------- tests
def test_pca_map_pixels_equal_the_api_and_the_first_neighbour_of_a_crop_is_its_photo(
    server: ServerProcess,
    open_tab: Callable[[ServerProcess], Tab],
    photos: dict[str, bytes],
    reference: Backbone,
) -> None:
    tab = open_tab(server)
    ready(tab)
    crop = jpeg_crop(photos["rocket"], 0.8)
    upload(tab, "rocket-crop.jpg", crop)
    options = api_options(form_options(tab))
    with server.client() as client:
        answer = client.post("/v1/patch-features", files={"image": crop}, data=options)
        assert answer.status_code == 200, answer.text
        searched = client.post("/v1/search", files={"image": crop}, data={"index": "photos", "k": "6"})
        assert searched.status_code == 200, searched.text
    body = answer.json()
    api_rgb = np.asarray(body["pca"]["rgb"])  # [h, w, 3] in [0, 1]
    drawn = canvas_rgb(tab, "#pca")
    assert drawn.shape == (*body["grid"], 3)
    assert np.abs(drawn.astype(int) - np.rint(api_rgb * 255)).max() == 0  # exact; the rule asks 1/255
    policy: Any = options["policy"]
    tokens = reference.embed(crop, pooling="patch", layers=[int(options["layer"])], policy=policy)[
        0
    ]  # [h, w, D]
    np.testing.assert_allclose(api_rgb, numpy_pca(tokens), atol=1 / 255)  # the sign rule: same colours
    ids = neighbour_ids(tab)
    assert ids[0] == "rocket.jpg"
    assert ids == [hit["id"] for hit in searched.json()["data"][0]["results"]]
    assert all(src.startswith("blob:" + server.url + "/") for src in wait_for_thumbnails(tab))
    assert (tab.errors, tab.failed) == ([], [])


def test_clicking_a_patch_puts_the_heat_maximum_on_the_same_patch_of_the_same_photo(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    tab.page.fill("#size-h", "112")
    tab.page.fill("#size-w", "112")
    upload(tab, "hubble.jpg", photos["hubble_deep_field"])  # the very file the index was built from
    assert neighbour_ids(tab)[0] == "hubble_deep_field.jpg"
    assert tab.page.get_attribute("#view", "data-grid") == "8x8"
    row, col = 3, 5
    click_patch(tab, row, col)
    tab.page.wait_for_function(f"() => document.getElementById('match-heat').dataset.patch === '{row},{col}'")
    heat = canvas_rgb(tab, "#match-heat").astype(int)  # [8, 8, 3], black -> red -> yellow
    assert heat.shape == (8, 8, 3)
    level = heat[..., 0] + heat[..., 1]  # grows with the cosine
    assert np.unravel_index(int(np.argmax(level)), level.shape) == (row, col)
    assert list(heat[row, col]) == [255, 255, 0]  # the highest cosine is yellow
    assert tab.page.get_attribute("#match-heat", "data-best") == f"{row},{col}"
    with server.client() as client:
        fields = {**api_options(form_options(tab)), "index": "photos", "id": "hubble_deep_field.jpg"}
        answer = client.post(
            "/v1/patch-similarity",
            files={"image": photos["hubble_deep_field"]},
            data={**fields, "row": str(row), "col": str(col)},
        ).json()
    assert answer["best"] == {"row": row, "col": col, "score": pytest.approx(1.0, abs=1e-5)}
    similarity = np.asarray(answer["similarity"])
    expected = (similarity - similarity.min()) / (similarity.max() - similarity.min())
    assert np.abs(level - np.rint(510 * expected)).max() <= 2  # the ramp of the API's cosines
    assert (tab.errors, tab.failed) == ([], [])


def test_changing_the_policy_redraws_the_grid(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    upload(tab, "rocket.jpg", photos["rocket"])  # 427 x 640: crop, squash and dynamic give different grids
    seen = {}
    for policy in ("crop", "dynamic", "squash", "pad"):
        before = tab.page.evaluate("Number(document.body.dataset.features)")
        tab.page.select_option("#policy", policy)
        if policy != "crop":  # crop is the tiny model's default: no change, no new request
            tab.page.wait_for_function(f"() => Number(document.body.dataset.features) > {before}")
        with server.client() as client:
            body = client.post(
                "/v1/patch-features", files={"image": photos["rocket"]}, data=api_options(form_options(tab))
            ).json()
        rows, cols = body["grid"]
        assert tab.page.get_attribute("#view", "data-grid") == f"{rows}x{cols}"
        assert tab.page.get_attribute("#view", "data-size") == "{}x{}".format(*body["size"])
        assert tab.page.get_attribute("#pca", "data-grid") == f"{rows}x{cols}"
        assert f"{rows} × {cols} = {rows * cols} patch tokens" in tab.page.inner_text("#view-caption")
        assert policy in tab.page.inner_text("#policy-help")
        seen[policy] = (rows, cols)
        holds = int(np.asarray(body["pca"]["foreground"]).sum())  # pad: the letterbox is left out, black
        assert (canvas_rgb(tab, "#pca").reshape(-1, 3).any(axis=1)).sum() <= holds
        assert (holds < rows * cols) == (policy == "pad")
    assert seen["crop"] == (4, 4) and seen["dynamic"] != (4, 4) and seen["dynamic"][1] > seen["dynamic"][0]
    # the background removed: the map is the API's thresholded one, background patches black
    before = tab.page.evaluate("Number(document.body.dataset.features)")
    tab.page.check("#background")
    tab.page.wait_for_function(f"() => Number(document.body.dataset.features) > {before}")
    fields = {**api_options(form_options(tab)), "background_threshold": "0.5"}
    with server.client() as client:
        pca = client.post("/v1/patch-features", files={"image": photos["rocket"]}, data=fields).json()["pca"]
    keep = np.asarray(pca["foreground"])
    assert 0 < keep.sum() < keep.size
    drawn = canvas_rgb(tab, "#pca")
    assert np.abs(drawn.astype(int) - np.rint(np.asarray(pca["rgb"]) * 255)).max() <= 1
    assert (drawn[~keep] == 0).all()
    assert f"{keep.sum()} of {keep.size} patches kept as foreground" in tab.page.inner_text("#pca-caption")
    assert (tab.errors, tab.failed) == ([], [])


def test_an_image_dropped_or_pasted_is_used(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    for event, name in (("drop", "chelsea"), ("paste", "coffee")):
        before = tab.page.evaluate("Number(document.body.dataset.features || 0)")
        tab.page.evaluate(
            """([event, encoded]) => {
                const bytes = Uint8Array.from(atob(encoded), (c) => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "photo.jpg", { type: "image/jpeg" }));
                const init = { bubbles: true, cancelable: true };
                if (event === "drop") {
                    const drop = document.getElementById("drop");
                    drop.dispatchEvent(new DragEvent("drop", { ...init, dataTransfer: data }));
                } else {
                    document.dispatchEvent(new ClipboardEvent("paste", { ...init, clipboardData: data }));
                }
            }""",
            [event, base64.b64encode(photos[name]).decode("ascii")],
        )
        tab.page.wait_for_function(f"() => Number(document.body.dataset.features || 0) > {before}")
        assert neighbour_ids(tab)[0] == f"{name}.jpg"
    assert (tab.errors, tab.failed) == ([], [])


def test_a_non_image_shows_the_servers_error_verbatim_and_nothing_of_the_previous_image(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    upload(tab, "coffee.jpg", photos["coffee"])
    neighbour_ids(tab)
    text = b"plain text, not a picture\n"
    with server.client() as client:
        error = client.post("/v1/patch-features", files={"image": text}).json()["error"]
    tab.page.set_input_files(
        "#file", files=[sync_api.FilePayload(name="notes.txt", mimeType="text/plain", buffer=text)]
    )
    tab.page.wait_for_function("() => document.getElementById('error').textContent !== ''")
    assert tab.page.inner_text("#error") == f"400 {error['code']}: {error['message']}"
    assert error["code"] == "not_an_image"
    assert tab.page.get_attribute("#error", "role") == "alert"
    # the coffee's pictures are gone: no picture on screen belongs to another image than the one chosen
    assert tab.page.eval_on_selector_all("#view, #pca, #match-heat", "cs => cs.map((c) => c.width)") == [
        1,
        1,
        1,
    ]
    assert tab.page.locator(".neighbour").count() == 0 and tab.page.is_hidden("#cost")
    assert tab.page.inner_text("#view-caption") == "No image yet."


def test_heads_predictions_are_shown(server: ServerProcess, open_tab: Callable[[ServerProcess], Tab]) -> None:
    tab = open_tab(server)
    ready(tab)
    buffer = io.BytesIO()
    labelled_image(CLASSES[2], seed=900).save(buffer, "PNG")
    shape = buffer.getvalue()
    upload(tab, "shape.png", shape, "image/png")
    tab.page.wait_for_selector("[data-head='shapes'] .result ol")
    tab.page.wait_for_selector("[data-head='regions'] .result canvas")
    with server.client() as client:
        linear = client.post("/v1/classify", files={"image": shape}, data={"head": "shapes", "top_k": "5"})
        patch = client.post("/v1/classify", files={"image": shape}, data={"head": "regions"})
    labels = linear.json()["data"][0]["labels"]
    shown = tab.page.eval_on_selector_all("[data-head='shapes'] li", "ls => ls.map((l) => l.textContent)")
    assert shown == [f"{x['label']}: {100 * x['probability']:.1f}% " for x in labels]
    assert labels[0]["label"] == CLASSES[2]
    grid = np.asarray(patch.json()["data"][0]["grid"])  # [h, w] class ids
    legend = tab.page.eval_on_selector_all(
        "[data-head='regions'] .swatch", "ss => ss.map((s) => getComputedStyle(s).backgroundColor)"
    )
    colours = np.asarray([[int(v) for v in c[4:-1].split(",")] for c in legend])  # "rgb(r, g, b)"
    assert len(colours) == len(patch.json()["classes"])
    drawn = canvas_rgb(tab, "[data-head='regions'] canvas")
    assert drawn.shape[:2] == grid.shape and (drawn == colours[grid]).all()
    assert (tab.errors, tab.failed) == ([], [])


def test_axe_core_finds_no_serious_violation(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    upload(tab, "chelsea.jpg", photos["chelsea"])
    neighbour_ids(tab)
    wait_for_thumbnails(tab)
    click_patch(tab, 1, 1)
    tab.page.wait_for_function("() => document.getElementById('match-heat').dataset.patch === '1,1'")
    tab.page.wait_for_selector("[data-head='shapes'] .result ol")
    results = axe_playwright.Axe().run(tab.page).response
    assert results["testEngine"]["version"].startswith("4.")
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']]}"
        for v in results["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert serious == []
    milder = [
        f"{v['id']} ({v['impact']})"
        for v in results["violations"]
        if v["impact"] not in ("serious", "critical")
    ]
    print(f"axe-core {results['testEngine']['version']}: milder findings {milder}")
    assert len(results["passes"]) > 10  # the scan did run its rules


FOCUS_KEY = "(e) => e.id || `${e.tagName.toLowerCase()}[data-id=${e.dataset.id}]`"


def test_keyboard_alone_reaches_and_operates_every_control(
    server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(server)
    ready(tab)
    page = tab.page
    choosers: list[FileChooser] = []
    page.on("filechooser", lambda chooser: choosers.append(chooser))  # intercepting before any key

    def focused() -> str:
        return page.evaluate(f"({FOCUS_KEY})(document.activeElement)")

    for _ in range(5):  # the file picker is the first control: Tab, then Space opens it
        page.keyboard.press("Tab")
        if focused() == "file":
            break
    assert focused() == "file"
    page.keyboard.press("Space")
    for _ in range(100):  # the chooser event comes from the browser, after the key: wait up to 10 s
        if choosers:
            break
        page.wait_for_timeout(100)
    assert choosers, "Space on the focused file picker opened no file chooser"
    choosers[0].set_files(
        files=[sync_api.FilePayload(name="coffee.jpg", mimeType="image/jpeg", buffer=photos["coffee"])]
    )
    page.wait_for_function("() => Number(document.body.dataset.features || 0) > 0")
    neighbour_ids(tab)
    controls = set(
        page.eval_on_selector_all(
            "input, select, button, [tabindex='0']",
            f"es => es.filter((e) => !e.disabled && e.getClientRects().length).map({FOCUS_KEY})",
        )
    )
    assert "api-key" not in controls and {"file", "policy", "view", "threshold"} <= controls

    def walk(key: str) -> list[str]:
        """Focus stops from the file picker round to it again (the browser's own stop between the end
        and the start of the page, the document itself, left out)."""
        stops = ["file"]
        for _ in range(3 * len(controls)):
            page.keyboard.press(key)
            if focused() == "file":
                return stops
            if focused() in controls:
                stops.append(focused())
        pytest.fail(f"{key} never came back to the file picker: {stops}")

    forward = walk("Tab")
    assert controls == set(forward)  # every control gets the focus, once a round
    assert len(forward) == len(controls)
    assert walk("Shift+Tab") == forward[:1] + forward[:0:-1]  # and Shift+Tab walks the same path back
    second = neighbour_ids(tab)[1]
    while focused() != f"button[data-id={second}]":
        page.keyboard.press("Tab")
    page.keyboard.press("Space")
    assert page.get_attribute(f".neighbour[data-id='{second}']", "aria-pressed") == "true"
    while focused() != "view":
        page.keyboard.press("Shift+Tab")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('match-heat').dataset.patch === '1,1'")
    assert page.get_attribute("#match-heat", "data-id") == second
    while focused() != "policy":
        page.keyboard.press("Shift+Tab")
    before = page.evaluate("Number(document.body.dataset.features)")
    page.keyboard.press("ArrowDown")  # a focused <select> changes with the arrow keys
    page.wait_for_function(f"() => Number(document.body.dataset.features) > {before}")
    assert (tab.errors, tab.failed) == ([], [])


def test_with_an_api_key_the_page_asks_for_it_sends_it_and_thumbnails_render(
    keyed_server: ServerProcess, open_tab: Callable[[ServerProcess], Tab], photos: dict[str, bytes]
) -> None:
    tab = open_tab(keyed_server)
    tab.page.wait_for_selector("#key-field:not([hidden])")
    assert tab.page.inner_text("#error").startswith("401 unauthorized: ")
    assert tab.page.evaluate("document.activeElement.id") == "api-key"
    tab.page.keyboard.type(API_KEY)
    tab.page.keyboard.press("Enter")
    ready(tab)
    assert tab.page.inner_text("#error") == ""
    upload(tab, "astronaut.jpg", photos["astronaut"])
    assert neighbour_ids(tab)[0] == "astronaut.jpg"
    assert all(src.startswith("blob:") for src in wait_for_thumbnails(tab))
    calls = [r for r in tab.requests if r.url.startswith(keyed_server.url + "/v1/")]
    authorised = [r for r in calls if r.headers.get("authorization") == f"Bearer {API_KEY}"]
    assert calls[0].url.endswith("/v1/models") and calls[0].headers.get("authorization") is None
    assert len(calls) >= 8 and authorised == calls[1:]  # refused once without it, then always sent
    assert any("/thumbnail?" in r.url for r in authorised)
    with keyed_server.client() as client:  # without the key a thumbnail is refused, as every /v1 route
        assert client.get("/v1/indexes/photos/thumbnail", params={"id": "astronaut.jpg"}).status_code == 401
