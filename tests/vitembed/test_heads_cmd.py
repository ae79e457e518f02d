"""``vitembed heads train | predict | show`` in process, and ``vitembed serve --head`` refusing a head
that fits no served model (a real process: one line, status 2, before any weights load)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from heads_synthetic import CLASSES, make_labelled_folder, make_segmentation_folder
from PIL import Image
from vitembed.cli.main import main

from vit_backbone import Backbone, load_backbone
from vit_backbone.heads import load_head, read_card
from vit_backbone.heads.data import read_labelled_folder
from vit_backbone.heads.predict import predict_masks, predict_proba
from vit_backbone.precision import cpu_has_native_bf16

ROOT = Path(__file__).resolve().parents[2]
# the tiny random-init model's patch head on 8 training images, 2 held out: measured 0.9302 and 0.8264
PIXEL_ACCURACY = 0.9
MIOU = 0.7


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cmd")
    return {
        "labelled": make_labelled_folder(root / "labelled", per_class=10),
        "fresh": make_labelled_folder(root / "fresh", per_class=2, seed=3),
        "seg": make_segmentation_folder(root / "seg", count=10),
    }


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_train_predict_show(
    capsys: pytest.CaptureFixture[str],
    data: dict[str, Path],
    tiny_path: Path,
    reference: Backbone,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    common = ("--data", data["labelled"], "--model", tiny_path, "--cache-dir", cache, "--pooling", "mean")
    status, out, err = run(capsys, "heads", "train", *common, "--out", tmp_path / "lin.safetensors")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == "trained a linear head on 24 images (3 classes)"
    assert lines[1] == "features: 30 computed, 0 from the cache"
    assert re.fullmatch(
        r"validation accuracy: 1\.0000 \(6 held out; chosen weight_decay=[0-9.e-]+\)", lines[2]
    )
    assert lines[3] == f"saved {tmp_path / 'lin.safetensors'} and {tmp_path / 'lin.json'}"
    # auto: float32 unless the CPU runs bfloat16 natively, where the rule also weighs cosine and speed
    precision = read_card(tmp_path / "lin.json").precision
    assert precision == "float32" or (precision == "bfloat16" and cpu_has_native_bf16())
    assert lines[4] == (
        f"features computed in {precision} (auto: serve's choice on this machine; recorded in the card)"
    )
    assert oct((tmp_path / "lin.safetensors").stat().st_mode & 0o777) == oct(
        (tmp_path / "lin.json").stat().st_mode & 0o777
    )
    knn = ("--kind", "knn", "--precision", precision, "--out", tmp_path / "knn")
    status, out, err = run(capsys, "heads", "train", *common, *knn)
    assert status == 0, err
    assert out.splitlines()[1] == "features: 0 computed, 30 from the cache"  # retraining reuses the features
    assert out.splitlines()[4] == f"features computed in {precision} (as asked; recorded in the card)"
    assert re.fullmatch(
        r"validation accuracy: 1\.0000 \(6 held out; chosen k=\d+, temperature=0\.07\)", out.splitlines()[2]
    )

    fresh = read_labelled_folder(data["fresh"])
    status, out, err = run(
        capsys, "heads", "predict", tmp_path / "lin.json", *fresh.paths, "--model", tiny_path, "--json"
    )
    assert status == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    head = load_head(tmp_path / "lin.safetensors")
    expected = predict_proba(reference, head, [p.read_bytes() for p in fresh.paths])
    for row, path, want in zip(rows, fresh.paths, expected, strict=True):
        assert row["image"] == str(path)
        assert [x["label"] for x in row["labels"]] == [CLASSES[i] for i in np.argsort(-want)]
        np.testing.assert_allclose([x["probability"] for x in row["labels"]], np.sort(want)[::-1], atol=1e-6)
    assert [r["labels"][0]["label"] for r in rows] == [CLASSES[i] for i in fresh.labels]

    status, out, _ = run(capsys, "heads", "show", tmp_path / "knn", "--json")
    assert status == 0 and json.loads(out) == read_card(tmp_path / "knn").to_dict()
    status, out, _ = run(capsys, "heads", "show", tmp_path / "knn")
    assert (
        "kind             knn" in out.splitlines()
        and "classes          blue_square, green_triangle, red_circle" in out
    )


def test_patch_head_and_masks_out(
    capsys: pytest.CaptureFixture[str], data: dict[str, Path], tiny_path: Path, tmp_path: Path,
    reference: Backbone,
) -> None:  # fmt: skip
    status, out, err = run(
        capsys, "heads", "train", "--data", data["seg"], "--kind", "patch", "--size", "112", "112",
        "--model", tiny_path, "--no-cache", "--out", tmp_path / "seg",
    )  # fmt: skip
    assert status == 0, err
    accuracy = re.search(
        r"^validation pixel accuracy: (0\.\d{4}) \(2 held out; chosen weight_decay=", out, re.M
    )
    miou = re.search(r"^validation mIoU: (0\.\d{4})$", out, re.M)
    assert accuracy and miou, out
    # a head that learned nothing (background everywhere) would have an mIoU of at most 1/3
    assert float(accuracy.group(1)) >= PIXEL_ACCURACY and float(miou.group(1)) >= MIOU, out
    image = data["seg"] / "000.png"
    status, out, err = run(
        capsys, "heads", "predict", tmp_path / "seg", image, "--model", tiny_path,
        "--masks-out", tmp_path / "m", "--json",
    )  # fmt: skip
    assert status == 0, err
    line = json.loads(out)
    assert line["shape"] == [112, 112] and line["mask"] == str(tmp_path / "m" / "000.mask.png")
    expected = predict_masks(reference, load_head(tmp_path / "seg"), [image.read_bytes()], upsample=True)[0]
    with Image.open(line["mask"]) as written:
        np.testing.assert_array_equal(np.asarray(written), expected)  # the PNG is the library's mask
    counts = np.bincount(expected.ravel(), minlength=3) / expected.size
    classes = ("background", "red_square", "blue_disc")
    assert line["shares"] == {
        classes[i]: round(float(counts[i]), 4) for i in np.argsort(-counts) if counts[i]
    }


@pytest.mark.parametrize(
    "form", [("--layers", "-2,-1"), ("--layers=-2,-1",), ("--layers", "-2", "-1"), ("--layers", "0,1")]
)
def test_layers_take_negative_indices_in_every_form(
    form: tuple[str, ...], capsys: pytest.CaptureFixture[str], data: dict[str, Path], tiny_path: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    status, _, err = run(
        capsys, "heads", "train", "--data", data["labelled"], "--model", tiny_path, "--pooling", "mean",
        *form, "--cache-dir", tmp_path / "cache", "--out", tmp_path / "h",
    )  # fmt: skip
    assert status == 0, err
    assert read_card(tmp_path / "h").layers == (0, 1)  # blocks -2, -1 of the 2-block model


def test_train_from_parquet(
    capsys: pytest.CaptureFixture[str], reference: Backbone, data: dict[str, Path], tmp_path: Path
) -> None:
    dataset = read_labelled_folder(data["labelled"])
    vectors = reference.embed([p.read_bytes() for p in dataset.paths], pooling="mean")
    meta = {
        "model": "tiny", "revision": reference.checkpoint.revision,
        "preprocess_hash": reference.preprocess_config.hash(),
        "pooling": "mean", "layers": None, "size": None, "policy": "crop", "normalized": False, "dim": 32,
        "dtype": "float32", "format_version": 1,
    }  # fmt: skip
    table = pa.table(
        {
            "id": [str(p) for p in dataset.paths],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), 32),
            "label": [dataset.classes[i] for i in dataset.labels],
        }
    ).replace_schema_metadata({b"vitembed": json.dumps(meta).encode()})
    pq.write_table(table, tmp_path / "vectors.parquet")
    status, out, err = run(
        capsys, "heads", "train", "--data", tmp_path / "vectors.parquet", "--out", tmp_path / "p"
    )
    assert status == 0, err
    assert out.splitlines()[0] == "trained a linear head on 24 catalog vectors (3 classes)"
    assert out.splitlines()[1].startswith("validation accuracy: 1.0000 (6 held out;")
    assert read_card(tmp_path / "p").revision == reference.checkpoint.revision


def test_train_on_embed_catalog_output(
    capsys: pytest.CaptureFixture[str], reference: Backbone, data: dict[str, Path], tiny_path: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The real ``vitembed embed-catalog`` output (the manifest's label carried as an extra column) is
    training data as it is: same vectors, same card facts."""
    dataset = read_labelled_folder(data["labelled"])
    manifest = tmp_path / "manifest.csv"
    rows = [
        f"{p.stem}-{dataset.classes[i]},{p},{dataset.classes[i]}"
        for p, i in zip(dataset.paths, dataset.labels, strict=True)
    ]
    manifest.write_text("id,path,label\n" + "\n".join(rows) + "\n")
    status, _, err = run(
        capsys, "embed-catalog", manifest, "--out", tmp_path / "catalog", "--model", f"tiny={tiny_path}",
        "--pooling", "mean", "--precision", "float32",
    )  # fmt: skip
    assert status == 0, err
    status, out, err = run(capsys, "heads", "train", "--data", tmp_path / "catalog", "--out", tmp_path / "h")
    assert status == 0, err
    assert out.splitlines()[0] == "trained a linear head on 24 catalog vectors (3 classes)"
    assert out.splitlines()[1].startswith("validation accuracy: 1.0000 (6 held out;")
    card = read_card(tmp_path / "h")
    assert (card.revision, card.preprocess_hash, card.pooling, card.layers, card.feature_dim) == (
        reference.checkpoint.revision, reference.preprocess_config.hash(), "mean", None, 32,
    )  # fmt: skip
    assert card.precision == "float32" and card.classes == CLASSES
    # the head runs on the backbone (the card fits it) and classifies unseen images right
    fresh = read_labelled_folder(data["fresh"])
    probabilities = predict_proba(
        reference, load_head(tmp_path / "h", reference), [p.read_bytes() for p in fresh.paths]
    )
    assert probabilities.argmax(1).tolist() == list(fresh.labels)


def test_mismatched_backbone_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], data: dict[str, Path], tiny_path: Path,
    make_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:  # fmt: skip
    status, _, err = run(
        capsys,
        "heads",
        "train",
        "--data",
        data["labelled"],
        "--model",
        tiny_path,
        "--no-cache",
        "--out",
        tmp_path / "h",
    )
    assert status == 0, err
    other = make_checkpoint("dinov2", seed=2)
    capsys.readouterr()  # drop the checkpoint writer's progress output
    card = read_card(tmp_path / "h")
    image = next(iter((data["labelled"] / CLASSES[0]).iterdir()))
    status, out, err = run(capsys, "heads", "predict", tmp_path / "h", image, "--model", other)
    assert status == 2 and out == ""
    assert err == (
        f"vitembed heads: error: head '{tmp_path / 'h'}' does not match backbone 'dinov2': "
        f"revision {card.revision} != {load_backbone(other).checkpoint.revision}\n"
    )
    status, _, err = run(
        capsys, "heads", "train", "--data", data["labelled"], "--out", tmp_path / "x", "--kind", "svm"
    )
    assert status == 2 and "argument --kind: invalid choice: 'svm'" in err

    # the server refuses it before loading weights: one line, status 2
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "vitembed", "serve", "--model", f"other={other}",
         "--head", f"h={tmp_path / 'h'}", "--port", "0"],
        cwd=ROOT, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    stderr = proc.stderr.decode()
    assert proc.returncode == 2, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith(f"vitembed serve: error: head 'h' ({tmp_path / 'h'}) fits no served model: ")


def test_head_settings_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError
    from vitembed.cli.heads import parse_head_args
    from vitembed.settings import ServiceSettings

    assert parse_head_args(["a=/h/a.safetensors", "b=/h/b"]) == {"a": "/h/a.safetensors", "b": "/h/b"}
    with pytest.raises(ValueError, match="--head 'a': expected NAME=PATH"):
        parse_head_args(["a"])
    with pytest.raises(ValueError, match="--head: the name 'a' is given twice"):
        parse_head_args(["a=/x", "a=/y"])
    monkeypatch.setenv("VITEMBED_HEADS", '{"kinds": "/heads/kinds"}')
    assert ServiceSettings().heads == {"kinds": "/heads/kinds"}
    with pytest.raises(ValidationError, match="head 'a,b': a name without"):
        ServiceSettings(heads={"a,b": "/x"})
    monkeypatch.delenv("VITEMBED_HEADS")
    assert ServiceSettings(heads={"h" * 64: "/x"}).heads == {"h" * 64: "/x"}
    with pytest.raises(ValidationError) as caught:
        ServiceSettings(heads={"h" * 65: "/x"})
    assert (
        f"head name {'h' * 64!r}... is 65 characters long; requests name heads with at most 64: choose a "
        "shorter name"
    ) in str(caught.value)
