"""Near-duplicate groups: blocked pairs equal the full matrix, components are the known groups, the CLI
writes the Parquet and summary."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw, ImageEnhance
from vitembed.cli.main import main

from vit_backbone.catalog.dedup import PRESET_THRESHOLDS, above_threshold_pairs, default_threshold
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import build_table, write_shard


def _write_catalog(folder: Path, ids: list[str], vectors: np.ndarray) -> None:
    meta = CatalogMeta("synthetic", "r0", "p0", "mean", [8], None, "pad", False, vectors.shape[1], "float32")
    half = len(ids) // 2
    folder.mkdir(parents=True)
    write_shard(folder, 0, build_table(ids[:half], vectors[:half], {}, meta))
    write_shard(folder, 1, build_table(ids[half:], vectors[half:], {}, meta))


def _pairwise(groups: dict[str, int]) -> set[frozenset[str]]:
    by_group: dict[int, list[str]] = {}
    for item, group in groups.items():
        by_group.setdefault(group, []).append(item)
    return {frozenset((a, b)) for m in by_group.values() for a in m for b in m if a < b}


def test_blocked_pairs_equal_the_full_matrix() -> None:
    x = np.random.default_rng(0).normal(size=(301, 16)).astype(np.float32)
    x[150] = x[3] + 0.01  # a planted pair across blocks
    i, j, s = above_threshold_pairs(x, 0.6, block=64)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    full = xn @ xn.T
    want = {(a, b) for a, b in zip(*np.nonzero(full >= 0.6), strict=True) if a < b}
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == want and (3, 150) in want
    np.testing.assert_allclose(s, full[i, j], atol=1e-6)


def test_cli_finds_the_planted_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(size=(40, 32)).astype(np.float32)  # 40 unrelated items
    ids = [f"item{k:02d}" for k in range(40)]
    vectors = [base]
    truth = {}
    for group, source in enumerate((3, 17, 31)):  # three groups: the source and two noisy copies each
        truth[ids[source]] = group
        for copy in range(2):
            ids.append(f"copy{group}-{copy}")
            vectors.append(base[source] + 0.05 * rng.normal(size=(1, 32)).astype(np.float32))
            truth[ids[-1]] = group
    _write_catalog(tmp_path / "cat", ids, np.concatenate(vectors))
    out = tmp_path / "dups.parquet"
    assert (
        main(["dedup", str(tmp_path / "cat"), "--out", str(out), "--threshold", "0.9", "--block", "7"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    table = pq.read_table(out).to_pydict()
    assert list(table) == ["group", "id", "similarity_to_representative"]
    found = dict(zip(table["id"], table["group"], strict=True))
    assert _pairwise(found) == _pairwise(truth)
    assert summary["groups"] == 3 and summary["rows_in_groups"] == 9 and summary["duplicates_to_drop"] == 6
    assert (summary["threshold"], summary["threshold_source"]) == (0.9, "given")
    assert json.loads((tmp_path / "dups.parquet.summary.json").read_text())["groups"] == 3
    sims = np.asarray(table["similarity_to_representative"])
    assert (sims > 0.9).all() and np.isclose(sims, 1.0, atol=1e-6).sum() == 3  # one representative each


def _copies(photo: Image.Image, seed: int) -> list[bytes]:
    """What re-uploads of one picture go through: re-encoding, downscaling, brightness, a border with a
    title bar (screenshot), a slight per-axis rescale."""
    rng = np.random.default_rng(seed)

    def jpeg(image: Image.Image, quality: int) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        return buffer.getvalue()

    w, h = photo.size
    boxed = Image.new("RGB", (w + 60, h + 90), (255, 255, 255))
    boxed.paste(photo, (30, 60))
    ImageDraw.Draw(boxed).rectangle((0, 0, boxed.width, 24), fill=(40, 40, 60))
    return [
        jpeg(photo, int(rng.integers(50, 80))),
        jpeg(photo.resize((w * 3 // 5, h * 3 // 5), Image.Resampling.BILINEAR), 90),
        jpeg(ImageEnhance.Brightness(photo).enhance(float(rng.uniform(0.85, 1.2))), 90),
        jpeg(boxed, 90),
        jpeg(photo.resize((w * 4 // 5, h * 2 // 3), Image.Resampling.BILINEAR), 85),
    ]


def _meta(preset: str | None, **changes: object) -> CatalogMeta:
    fields: dict[str, object] = {
        "model": "embedded",
        "revision": "r",
        "preprocess_hash": "p",
        "pooling": "cls_mean_hflip",
        "layers": [8],
        "size": [98, 98],
        "policy": "trim_squash",
        "normalized": False,
        "dim": 768,
        "dtype": "float32",
        "preset": preset,
    }
    return CatalogMeta(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_default_threshold_is_the_one_calibrated_for_the_catalogs_own_features() -> None:
    assert default_threshold(_meta("default-v3")) == (
        PRESET_THRESHOLDS["default-v3"],
        "calibrated for default-v3",
    )
    v2 = _meta("default-v2", pooling="mean", size=None, dim=384)
    assert default_threshold(v2) == (PRESET_THRESHOLDS["default-v2"], "calibrated for default-v2")
    # a preset's name with other options, another model, or no preset: the current default's, said so
    for meta in (
        _meta("default-v3", pooling="mean", dim=384),
        _meta("default-v3", size=None),
        _meta("default-v3", model="dinov2-small"),
        _meta(None),
        _meta("default-v1", pooling="mean", size=None, policy="pad", dim=384),
    ):
        threshold, source = default_threshold(meta)
        assert source == "uncalibrated for these features: default-v3's", meta
        assert threshold == PRESET_THRESHOLDS["default-v3"]


@pytest.mark.slow
def test_dedup_on_real_photos_recovers_the_copies_not_similar_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Embedded backbone, default preset and threshold: 8 originals (two non-overlapping views of each of 4
    photos: the hard negatives are other parts of the same picture), each with 5 copies, plus 4 unrelated
    photos without copies. Pairwise precision and recall of the groups >= 0.95."""
    from skimage import data as skd

    folder = tmp_path / "images"
    folder.mkdir()
    truth: dict[str, int] = {}
    group = 0
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        array = getattr(skd, name)()
        h, w = array.shape[:2]
        views = (array[: h * 3 // 4, : w // 2], array[h // 4 :, w // 2 :])  # two different, similar pictures
        for view in views:
            photo = Image.fromarray(view).convert("RGB")
            photo.save(folder / f"{name}-{group}.png")
            truth[f"{name}-{group}"] = group
            for k, encoded in enumerate(_copies(photo, seed=group)):
                (folder / f"{name}-{group}-copy{k}.jpg").write_bytes(encoded)
                truth[f"{name}-{group}-copy{k}"] = group
            group += 1
    for name in ("immunohistochemistry", "hubble_deep_field", "coins", "camera"):  # singletons
        Image.fromarray(getattr(skd, name)()).convert("RGB").save(folder / f"single-{name}.png")
    assert main(["embed-catalog", str(folder), "--out", str(tmp_path / "cat")]) == 0
    capsys.readouterr()
    out = tmp_path / "dups.parquet"
    assert main(["dedup", str(tmp_path / "cat"), "--out", str(out)]) == 0  # the default threshold
    summary = json.loads(capsys.readouterr().out)
    assert summary["threshold_source"] == "calibrated for default-v3"
    table = pq.read_table(out).to_pydict()
    found = {Path(str(i)).stem: g for i, g in zip(table["id"], table["group"], strict=True)}
    got, want = _pairwise(found), _pairwise(truth)
    precision = len(got & want) / max(1, len(got))
    recall = len(got & want) / len(want)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall, sorted(map(sorted, got ^ want))[:10])


def test_cli_reads_a_lancedb_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same groups from the catalog and from the table `index build` made of it (--table)."""
    from vit_backbone.catalog.index_build import build_index

    rng = np.random.default_rng(2)
    base = rng.normal(size=(30, 16)).astype(np.float32)
    ids = [f"item{k:02d}" for k in range(30)] + ["copy-a", "copy-b"]
    vectors = np.concatenate([base, base[[4]] + 0.01, base[[20]] + 0.01]).astype(np.float32)
    _write_catalog(tmp_path / "cat", ids, vectors)
    build_index(tmp_path / "cat", tmp_path / "db", "items")
    for argv, out in (
        ([str(tmp_path / "cat")], tmp_path / "a.parquet"),
        ([str(tmp_path / "db"), "--table", "items"], tmp_path / "b.parquet"),
    ):
        assert main(["dedup", *argv, "--out", str(out), "--threshold", "0.95"]) == 0
        capsys.readouterr()
    a, b = (pq.read_table(tmp_path / f"{n}.parquet").to_pydict() for n in ("a", "b"))
    pairs = [_pairwise(dict(zip(t["id"], t["group"], strict=True))) for t in (a, b)]
    assert pairs[0] == pairs[1] == {frozenset(("item04", "copy-a")), frozenset(("item20", "copy-b"))}
