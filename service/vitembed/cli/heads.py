"""``vitembed heads``: train, run and describe frozen heads from the command line.

``train`` computes features once (cached under ``--cache-dir``, default ``~/.cache/vitembed/features``),
fits the head, prints its validation accuracy (and mIoU for patch heads) and writes ``HEAD.safetensors`` +
``HEAD.json`` (or a folder). ``predict`` prints each image's top classes (patch heads: class shares, and
masks written with ``--masks-out``); ``show`` prints the card. Heavy imports happen inside each command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vitembed.cli.options import add_k, add_layers, add_server, add_size

DEFAULT_CACHE = Path("~/.cache/vitembed/features")


def parse_head_args(values: list[str]) -> dict[str, str]:
    """``--head NAME=PATH`` (repeatable)."""
    heads: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--head {value!r}: expected NAME=PATH (HEAD.safetensors, HEAD.json or a folder)"
            )
        if name in heads:
            raise ValueError(f"--head: the name {name!r} is given twice")
        heads[name] = path
    return heads


def configure_heads(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="heads_command", metavar="ACTION", required=True)
    train = actions.add_parser("train", help="train a head on a labelled folder or catalog Parquet")
    train.add_argument(
        "--data", required=True, help="FOLDER (one subfolder per class; masks for patch) or Parquet"
    )
    train.add_argument("--out", required=True, help="HEAD.safetensors (+ HEAD.json beside it) or a folder")
    train.add_argument(
        "--model", default=None, help="backbone (default: embedded; Parquet: none, or checked)"
    )
    train.add_argument("--kind", choices=("linear", "knn", "patch"), default="linear")
    train.add_argument("--pooling", default=None, help="default: the model's (patch heads: patch)")
    add_layers(train)
    train.add_argument(
        "--precision",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="features' compute precision, recorded in the card; auto: what `vitembed serve` picks on this "
        "machine (bfloat16 where the CPU runs it natively and it stays within cosine 0.999 of float32)",
    )
    add_size(train)
    train.add_argument("--policy", default=None, help="crop | squash | pad | dynamic (patch heads: squash)")
    train.add_argument(
        "--preset", default=None, help="named defaults: default-v3 (current) | default-v2 | default-v1"
    )
    train.add_argument("--val-fraction", type=float, default=0.2, help="held-out share for model selection")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where features are cached")
    train.add_argument("--no-cache", action="store_true", help="compute features without the disk cache")
    train.set_defaults(heads_run=_train)

    predict = actions.add_parser("predict", help="run a head on images")
    predict.add_argument("head", metavar="HEAD")
    predict.add_argument("images", metavar="IMAGE", nargs="+", type=Path)
    predict.add_argument("--model", default="embedded", help="the backbone the head was trained on")
    add_k(predict, 3, "labels per image (classifier heads)")
    add_server(
        predict,
        "run on a running `vitembed serve` (e.g. http://127.0.0.1:8000) instead of loading the model "
        "here; HEAD is then the name of a head it serves (--head NAME=PATH)",
    )
    predict.add_argument("--json", action="store_true", help="one JSON object per image")
    predict.add_argument("--masks-out", type=Path, default=None, help="patch heads: write X.mask.png here")
    predict.set_defaults(heads_run=_predict)

    show = actions.add_parser("show", help="print a head's card")
    show.add_argument("head", metavar="HEAD")
    show.add_argument("--json", action="store_true")
    show.set_defaults(heads_run=_show)


def run_heads(args: argparse.Namespace) -> int:
    status: int = args.heads_run(args)
    return status


def _train(args: argparse.Namespace) -> int:
    from vit_backbone import load_backbone
    from vit_backbone.heads import FeatureCache, TrainOptions, save_head, train_head
    from vit_backbone.heads.train import is_parquet_source

    options = TrainOptions(
        kind=args.kind,
        pooling=args.pooling,
        layers=args.layers,
        size=args.size,
        policy=args.policy,
        preset=args.preset,
        val_fraction=args.val_fraction,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    parquet = is_parquet_source(args.data)
    model = args.model if args.model is not None or parquet else "embedded"
    backbone = load_backbone(model) if model is not None else None
    if backbone is not None:  # the precision `serve` will pick (same rule), so the card matches the server
        from vit_backbone.catalog.precision import choose_precision

        choose_precision(backbone, args.precision, batch_size=args.batch_size)
    cache = None if args.no_cache or parquet else FeatureCache(args.cache_dir)
    result = train_head(backbone, args.data, options, cache=cache)
    card = result.card
    weights, card_file = save_head(result.head, args.out)
    source = "catalog vectors" if parquet else "images"
    print(f"trained a {card.kind} head on {card.train_count} {source} ({len(card.classes)} classes)")
    if not parquet:
        print(f"features: {result.cache.computed} computed, {result.cache.hits} from the cache")
    chosen = {k: v for k, v in card.hyperparameters.items() if k in ("weight_decay", "k", "temperature")}
    if card.val_accuracy is None:
        print("validation accuracy: n/a (no held-out split)")
    else:
        what = "pixel accuracy" if card.kind == "patch" else "accuracy"
        print(f"validation {what}: {card.val_accuracy:.4f} ({card.val_count} held out; chosen {_kv(chosen)})")
    if card.val_miou is not None:
        print(f"validation mIoU: {card.val_miou:.4f}")
    print(f"saved {weights} and {card_file}")
    if card.precision is not None:
        why = "auto: serve's choice on this machine" if args.precision == "auto" else "as asked"
        print(f"features computed in {card.precision} ({why}; recorded in the card)")
    return 0


def _kv(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _predict(args: argparse.Namespace) -> int:
    if args.server:
        return _predict_remote(args)
    from vit_backbone import load_backbone
    from vit_backbone.heads import load_head
    from vit_backbone.heads.predict import predict_masks, predict_proba

    backbone = load_backbone(args.model)
    head = load_head(args.head, backbone)
    images = [path.read_bytes() for path in args.images]
    classes = head.card.classes
    if head.card.kind == "patch":
        return _predict_patch(args, backbone, head, images, predict_masks)
    probabilities = predict_proba(backbone, head, images)  # [n, C]
    k = max(1, min(args.k, len(classes)))
    for path, row in zip(args.images, probabilities, strict=True):
        order = row.argsort()[::-1][:k]
        labels = [{"label": classes[i], "probability": float(row[i])} for i in order]
        if args.json:
            print(json.dumps({"image": str(path), "labels": labels}))
        else:
            print(f"{path}: " + ", ".join(f"{x['label']} {x['probability']:.3f}" for x in labels))
    return 0


def _predict_remote(args: argparse.Namespace) -> int:
    """``--server``: the served head answers (classifier heads); printed as the local prediction is."""
    from vitembed.cli.remote import classify

    answers = classify(
        args.server,
        str(args.head),
        [path.read_bytes() for path in args.images],
        max(1, args.k),
        api_key=args.api_key,
    )
    for path, labels in zip(args.images, answers, strict=True):
        if args.json:
            print(json.dumps({"image": str(path), "labels": labels}))
        else:
            print(f"{path}: " + ", ".join(f"{x['label']} {x['probability']:.3f}" for x in labels))
    return 0


def _predict_patch(
    args: argparse.Namespace, backbone: Any, head: Any, images: list[bytes], predict: Any
) -> int:
    import numpy as np
    from PIL import Image

    classes = head.card.classes
    masks = predict(backbone, head, images, upsample=args.masks_out is not None)
    for path, mask in zip(args.images, masks, strict=True):
        counts = np.bincount(mask.ravel(), minlength=len(classes)) / mask.size
        shares = {classes[i]: round(float(counts[i]), 4) for i in np.argsort(-counts) if counts[i] > 0}
        line: dict[str, Any] = {"image": str(path), "shape": list(mask.shape), "shares": shares}
        if args.masks_out is not None:
            args.masks_out.mkdir(parents=True, exist_ok=True)
            out = args.masks_out / f"{path.stem}.mask.png"
            Image.fromarray(mask.astype(np.uint8), mode="L").save(out)
            line["mask"] = str(out)
        print(
            json.dumps(line)
            if args.json
            else f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in shares.items())
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    from vit_backbone.heads import read_card
    from vit_backbone.heads.io import card_summary

    card = read_card(args.head)
    sys.stdout.write((card.to_json() if args.json else card_summary(card)) + "\n")
    return 0
