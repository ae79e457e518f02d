"""Train your own torch head on a frozen backbone.

The backbone runs once per image under ``torch.inference_mode`` (``Backbone.features()``); only the small
head below learns. The task is generated, so the example needs no data set: grey circles, squares and
triangles of random size, position and brightness on a noisy background — three classes that differ only
in shape. Run it:

    python examples/own_head.py                       # the embedded backbone
    python examples/own_head.py --model /path/to/dinov2-small

It prints the test accuracy (chance is 1/3).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from vit_backbone import Backbone, load_backbone
from vit_backbone.preprocess import stack

SHAPES = ("circle", "square", "triangle")


def make_images(count: int, seed: int) -> tuple[list[Image.Image], np.ndarray]:
    """``count`` images, classes in turn, each 96x96 with one grey shape."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for index in range(count):
        label = index % len(SHAPES)
        noise = rng.integers(0, 60, size=(96, 96, 1)).repeat(3, axis=2)
        image = Image.fromarray((40 + noise).astype(np.uint8))
        side = int(rng.integers(30, 70))
        left, top = (int(v) for v in rng.integers(0, 96 - side, size=2))
        box = (left, top, left + side, top + side)
        grey = int(rng.integers(150, 256))
        draw = ImageDraw.Draw(image)
        if SHAPES[label] == "circle":
            draw.ellipse(box, fill=(grey, grey, grey))
        elif SHAPES[label] == "square":
            draw.rectangle(box, fill=(grey, grey, grey))
        else:
            draw.polygon(
                [((box[0] + box[2]) // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=(grey,) * 3
            )
        images.append(image)
        labels.append(label)
    return images, np.asarray(labels)


def frozen_features(backbone: Backbone, images: Sequence[Image.Image], batch_size: int = 16) -> torch.Tensor:
    """CLS token + mean patch token of the last block, [N, 2D]. The backbone never sees a gradient."""
    rows = []
    for start in range(0, len(images), batch_size):
        pixel_values, _ = stack(backbone.prepare(list(images[start : start + batch_size]), policy="squash"))
        features = backbone.features(pixel_values)  # runs under torch.inference_mode
        cls = features.cls if features.cls is not None else features.pooler  # [b, D]
        rows.append(torch.cat([cls, features.patches.flatten(1, 2).mean(1)], dim=1).float())  # [b, 2D]
    return torch.cat(rows).clone()  # a normal tensor (inference tensors cannot enter autograd)


class MLPHead(torch.nn.Module):
    """Your head: anything torch can train. Here, standardise → 256 hidden units → classes."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, classes: int) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(len(mean), 256),
            torch.nn.GELU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(256, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)  # [B, classes] logits


def train(head: MLPHead, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=1e-2)
    head.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(x)).split(32):
            loss = torch.nn.functional.cross_entropy(head(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    head.eval()


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--train", type=int, default=150, help="training images")
    parser.add_argument("--test", type=int, default=90, help="test images")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    backbone = load_backbone(args.model)
    train_images, train_labels = make_images(args.train, seed=args.seed)
    test_images, test_labels = make_images(args.test, seed=args.seed + 1)
    x_train = frozen_features(backbone, train_images)  # [N, 2D]
    x_test = frozen_features(backbone, test_images)
    y_train = torch.from_numpy(train_labels)

    head = MLPHead(x_train.mean(0), x_train.std(0).clamp_min(1e-6), len(SHAPES))
    train(head, x_train, y_train, args.epochs, args.seed)
    with torch.no_grad():
        predicted = head(x_test).argmax(1).numpy()
    accuracy = float((predicted == test_labels).mean())
    print(f"frozen {backbone.checkpoint.name} features: {x_train.shape[1]} per image")
    print(f"test accuracy: {accuracy:.3f} (chance {1 / len(SHAPES):.3f}, {args.test} test images)")
    return accuracy


if __name__ == "__main__":
    main()
