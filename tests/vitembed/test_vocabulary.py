"""One vocabulary across commands, HTTP and the library: ``k`` (alias ``top_k`` / ``--top-k``), ``--layers``
in both forms on every command, one number for ``size`` meaning a square, ``--device auto`` by default,
and CLI errors that speak in flags."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from vitembed.cli.main import build_parser, main
from vitembed.cli.options import DEFAULT_DEVICE, cli_words
from vitembed.settings import ServiceSettings

from vit_backbone import Backbone

if TYPE_CHECKING:
    from conftest import Images, OpenServer

LAYER_COMMANDS = [
    ["embed-catalog", "src", "--out", "o"],
    ["heads", "train", "--data", "d", "--out", "o"],
    ["eval", "retrieval"],
]
SIZE_COMMANDS = [*LAYER_COMMANDS, ["inspect", "vit-b16"]]


@pytest.mark.parametrize("argv", LAYER_COMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize("form", [["-4", "-3", "-2", "-1"], ["-4,-3,-2,-1"], ["-4,-3", "-2", "-1"]])
def test_layers_take_both_forms_on_every_command(argv: list[str], form: list[str]) -> None:
    args = build_parser().parse_args([*argv, "--layers", *form])
    assert args.layers == (-4, -3, -2, -1)


@pytest.mark.parametrize("argv", SIZE_COMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize(
    ("given", "size"),
    [
        (["256"], (256, 256)),
        (["256", "320"], (256, 320)),
        (["256x320"], (256, 320)),
        (["256,320"], (256, 320)),
    ],
)
def test_one_size_number_is_a_square_on_every_command(
    argv: list[str], given: list[str], size: tuple[int, int]
) -> None:
    assert build_parser().parse_args([*argv, "--size", *given]).size == size


@pytest.mark.parametrize(
    "argv", [["search", "--db", "d", "--table", "t", "q.jpg"], ["heads", "predict", "h", "q.jpg"]]
)
def test_k_and_its_alias_top_k(argv: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args([*argv, "--k", "7"]).k == 7
    assert parser.parse_args([*argv, "--top-k", "7"]).k == 7


def test_one_device_default() -> None:
    parser = build_parser()
    # embed-catalog leaves an unset --device as None (so that --server can refuse a given one) and runs on
    # DEFAULT_DEVICE; the server's setting has the same default, and the help says it
    assert parser.parse_args(["embed-catalog", "src", "--out", "o"]).device is None
    assert DEFAULT_DEVICE == ServiceSettings().device == "auto"
    catalog_help = " ".join(
        parser._subparsers._group_actions[0].choices["embed-catalog"].format_help().split()
    )  # type: ignore[union-attr]
    assert "auto (auto: CUDA when available, else the CPU) (default: auto)" in catalog_help
    help_text = parser.parse_args(["serve"])  # serve leaves unset flags to the settings
    assert help_text.device is None


def test_cli_size_errors_speak_flags(
    capsys: pytest.CaptureFixture[str], tiny_path: Path, tmp_path: Path, images: Images
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jpg").write_bytes(images.jpeg())
    capsys.readouterr()
    argv = ["embed-catalog", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--model", str(tiny_path)]
    assert main([*argv, "--size", "100", "--precision", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("vitembed embed-catalog: error: --policy crop: the requested size 100x100 is not")
    assert "Pass --size with multiples of the patch, or use --policy dynamic" in err
    assert "size=" not in err and "policy=" not in err
    assert main(["inspect", "vit-b16", "--size", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitembed inspect: error: --size takes 256 (a square), 'H W' or 'HxW' with positive whole numbers; "
        "got '0'"
    )


def test_cli_words() -> None:
    assert cli_words("policy='crop': Pass size= with multiples, or use policy=\"dynamic\".") == (
        "--policy crop: Pass --size with multiples, or use --policy dynamic."
    )


def test_library_size_one_number_is_a_square(reference: Backbone, images: Images) -> None:
    batch = [images.jpeg()]
    square = reference.embed_result(batch, size=56, policy="squash")
    pair = reference.embed_result(batch, size=(56, 56), policy="squash")
    np.testing.assert_array_equal(square.vectors, pair.vectors)
    assert square.size == (56, 56)


@pytest.mark.anyio
async def test_http_size_one_number_is_a_square(serve: OpenServer, images: Images) -> None:
    async with serve() as server:
        answers = []
        for size in ("56", "56,56", "56x56"):
            response = await server.client.post(
                "/v1/embed",
                files={"image": images.jpeg()},
                data={"size": size, "policy": "squash", "return_grid": "true"},
            )
            assert response.status_code == 200, response.text
            answers.append(response.json()["data"])
        assert answers[0] == answers[1] == answers[2] and answers[0][0]["grid"] == [4, 4]
        as_json = await server.client.post(
            "/v1/embed",
            json={"images": [{"base64": images.b64(images.jpeg())}], "size": 56, "policy": "squash"},
        )
        assert as_json.status_code == 200, as_json.text
        assert as_json.json()["data"][0]["embedding"] == answers[0][0]["embedding"]
