"""``Backbone``: one loaded checkpoint, its declared rules, and the three calls people need.

``features()`` gives typed token sets for heads, ``embed()`` goes from images to pooled numpy arrays, and
``info()`` states every fact that decides what the numbers mean (family, grid, prefix tokens,
interpolation rule, preprocessing hash).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from .backbone_facts import BackboneInfo, EmbedDefaults, EmbedResult, backbone_info
from .checkpoint import CheckpointFacts, ResolvedCheckpoint
from .errors import InvalidOptionError, SizeError
from .features import Features, LayerTokens
from .graphs import ForwardGraphs
from .model_config import ModelConfig
from .module_paths import find_blocks, get_attr
from .passes import Pass, up_to_blocks, whole_network
from .pool_requests import pooled_many
from .pooling import (
    WHOLE_NETWORK,
    Pooling,
    check_pooling,
    is_mirrored,
    pool,
    pool_layers,
    pooled_array,
    pooled_dim,
)
from .pos_embed import PositionTableCache, image_box, install_position_rule
from .preprocess import (
    Prepared,
    PreprocessConfig,
    Preprocessor,
    ResizePolicy,
    batches_by_grid,
    check_policy,
    stack,
    stack_valid,
)
from .preprocess_config import NATIVE, SizeChoice, nearest_multiples, square_size
from .presets import DEFAULT_PRESET, check_preset
from .projection import ImageProjection
from .specs import InterpolationRule, ResampleMethod

__all__ = ["Backbone", "BackboneInfo", "EmbedDefaults", "EmbedResult", "ImageInput", "LayersArg"]

ImageInput = Image.Image | bytes
LayersArg = int | Sequence[int] | None


class Backbone:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        checkpoint: ResolvedCheckpoint,
        preprocess: PreprocessConfig,
        *,
        interpolation: InterpolationRule = "transformers",
        presets: dict[str, EmbedDefaults] | None = None,
        preset: str | None = None,
        autocast: torch.dtype | None = None,
        projection: ImageProjection | None = None,
    ) -> None:
        spec = config.spec
        self.model = model
        self.spec = spec
        self.model_config = config
        self.config = dict(config.raw)  # config.json as written
        self.checkpoint = checkpoint
        self.patch_size = config.patch_size
        self.native_grid = config.native_grid
        self.num_registers = config.num_registers
        self.prefix_tokens = config.prefix_tokens
        self.depth = config.depth
        self.dim = config.dim
        self.heads = config.heads
        self.interpolation: InterpolationRule = interpolation
        self.resample: ResampleMethod = spec.resample_method(interpolation)
        self.projection = projection  # a full CLIP/SigLIP checkpoint's joint image-text space; else None
        # every named preset's defaults (vit_backbone.presets); `defaults` = the chosen one's
        self.presets = presets or {DEFAULT_PRESET: EmbedDefaults(spec.default_pooling, preset=DEFAULT_PRESET)}
        self.defaults = self.preset_defaults(preset)
        self.autocast = autocast
        self.preprocess_config = preprocess
        # `dynamic`'s default token budget is the grid the checkpoint is *used* at (its processor's output,
        # e.g. 224 px = 16x16 for DINOv2), not its position table (518 px = 37x37): 5x fewer FLOPs.
        box_h, box_w = preprocess.default_box
        self.processing_grid = (max(1, box_h // self.patch_size[0]), max(1, box_w // self.patch_size[1]))
        self.preprocessor = Preprocessor(preprocess, self.patch_size, self.processing_grid)
        self._final_norm: torch.nn.Module = get_attr(model, spec.final_norm)
        self._blocks_owner, self._blocks_name = find_blocks(model, self.depth)
        self._forward_lock = threading.Lock()  # early-exit hooks live on shared blocks: one forward at a time
        self._positions: PositionTableCache | None = None
        # per image (rows, cols) of the image inside a letterboxed grid, set for one forward under the lock
        self._image_boxes: list[tuple[int, int, int, int] | None] | None = None
        self.graphs: ForwardGraphs | None = None  # use_graphs()
        self._takes_attention_mask = "attention_mask" in inspect.signature(model.forward).parameters
        if spec.pos_embed == "learned":
            self._install_position_rule()

    # ------------------------------------------------------------------ positions
    def _install_position_rule(self) -> None:
        """Route the model's own position lookup through our declared rule and per-grid cache."""
        table = get_attr(self.model, self.spec.pos_table_attr)
        self._positions = install_position_rule(
            get_attr(self.model, "embeddings"),
            table,
            has_cls=self.spec.pos_table_has_cls,
            method=self.resample,
            patch_size=self.patch_size,
            image_boxes=lambda: self._image_boxes,
        )
        self.native_grid = self._positions.source_grid

    # ------------------------------------------------------------------ layers
    def resolve_layers(self, layers: LayersArg) -> list[int] | None:
        """0-based block indices (negative from the end); an int picks one block. None = last block."""
        if layers is None:
            return None
        chosen = [layers] if isinstance(layers, int) else list(layers)
        if not chosen:
            raise InvalidOptionError("layers must name at least one block, e.g. [-1] or [-4, -3, -2, -1]")
        resolved: list[int] = []
        for index in chosen:
            if isinstance(index, bool) or not isinstance(index, int):
                raise InvalidOptionError(f"layers must be integers, got {index!r}")
            if not -self.depth <= index < self.depth:
                raise InvalidOptionError(
                    f"layer {index} does not exist: this model has {self.depth} blocks "
                    f"(valid: 0..{self.depth - 1} or -{self.depth}..-1)"
                )
            resolved.append(index % self.depth)
        if len(set(resolved)) != len(resolved):
            raise InvalidOptionError(f"layers {chosen} name the same block twice")
        return resolved

    def preset_defaults(self, preset: str | None = None) -> EmbedDefaults:
        """The defaults of the named preset (None: this backbone's own); InvalidOptionError if unknown."""
        if preset is None and hasattr(self, "defaults"):
            return self.defaults
        return self.presets[check_preset(preset)]

    def choose(
        self, pooling: str | None, layers: LayersArg, preset: str | None = None
    ) -> tuple[Pooling, list[int] | None]:
        """The pooling and blocks a call uses: what it asks for, else the preset's (None: this backbone's
        defaults); validated."""
        defaults = self.preset_defaults(preset)
        chosen_pooling = check_pooling(pooling or defaults.pooling)
        if chosen_pooling == "projection" and self.projection is None:
            raise InvalidOptionError(
                "pooling='projection' needs a full CLIP or SigLIP checkpoint (with its image projection); "
                "this one has none: use pooling='cls', 'mean' or 'pooler'"
            )
        chosen = layers if layers is not None else defaults.layers
        return chosen_pooling, self.resolve_layers(chosen)

    def choose_size(
        self, size: SizeChoice | None, preset: str | None = None, pooling: str | None = None
    ) -> tuple[int, int] | None:
        """The box a call uses: what it asks for (one number: a square; ``"native"``: the model's own),
        else the preset's (None: this backbone's defaults); None means the model's native size. A preset's
        box was chosen for its vector feature: dense output (``pooling="patch"``) keeps the native box
        unless a size is given."""
        if size == NATIVE:
            return None
        chosen = square_size(size)
        if chosen is not None or pooling == "patch":
            return chosen
        return self.preset_defaults(preset).size

    # ------------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast)

    def check_pixel_size(self, height: int, width: int) -> tuple[int, int]:
        patch_h, patch_w = self.patch_size
        if height % patch_h or width % patch_w or height < patch_h or width < patch_w:
            raise SizeError(
                f"pixel size {height}x{width} is not a positive multiple of the patch {patch_h}x{patch_w}: "
                f"the remainder would be dropped silently. Nearest multiples: "
                f"{nearest_multiples(height, patch_h)}x{nearest_multiples(width, patch_w)}; "
                f"resize with a policy (e.g. policy='dynamic') instead."
            )
        return height // patch_h, width // patch_w

    @contextlib.contextmanager
    def _letterbox(self, valid: torch.Tensor | None, kwargs: dict[str, Any]) -> Iterator[None]:
        """Inside the forward lock: letterbox tokens are masked out of attention (families whose model takes
        an attention mask) and image patches get the positions of the image's own grid, so a letterboxed
        image is seen as if it were the whole input whatever the box around it."""
        if valid is None:
            yield
            return
        covered = valid > 0  # [B, h, w]
        if self._takes_attention_mask:
            prefix = torch.ones(covered.shape[0], self.prefix_tokens, dtype=torch.long)
            kwargs["attention_mask"] = torch.cat([prefix, covered.flatten(1).long()], dim=1).to(self.device)
        self._image_boxes = [image_box(m) for m in covered]
        try:
            yield
        finally:
            self._image_boxes = None

    @torch.inference_mode()
    def features(
        self, pixel_values: torch.Tensor, *, layers: LayersArg = None, valid: torch.Tensor | None = None
    ) -> Features:
        """Tokens of one forward pass; ``valid`` [B, h, w] (``stack_valid``) marks the image patches."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
            raise InvalidOptionError(f"pixel_values must be [B, 3, H, W], got {list(pixel_values.shape)}")
        grid = self.check_pixel_size(int(pixel_values.shape[2]), int(pixel_values.shape[3]))
        chosen = self.resolve_layers(layers) or []
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)  # [B, 3, H, W]
        kwargs: dict[str, Any] = {"output_hidden_states": True}
        if self.spec.needs_interpolate_flag:
            kwargs["interpolate_pos_encoding"] = True

        eager = whole_network(self.model, kwargs, chosen)
        outputs = self._run_pass(("all", grid, tuple(chosen)), eager, pixel_values, valid, kwargs)
        with self._autocast():
            last = self._split(self._final_norm(outputs[0]), grid, valid)
            per_layer = {
                i: self._split(self._final_norm(outputs[1 + k]), grid, valid) for k, i in enumerate(chosen)
            }
        pooler = outputs[1 + len(chosen)] if len(outputs) > 1 + len(chosen) else None
        projection = None
        if self.projection is not None:
            with self._autocast():
                projection = self.projection(pooler, last.patches, valid)  # [B, E]
        return Features(
            projection=projection,
            cls=last.cls,
            registers=last.registers,
            patches=last.patches,
            pooler=pooler,
            layers=per_layer,
            valid=last.valid,
        )

    @torch.inference_mode()
    def layer_features(
        self, pixel_values: torch.Tensor, layers: LayersArg, *, valid: torch.Tensor | None = None
    ) -> dict[int, LayerTokens]:
        """Only the requested blocks' tokens (through the final norm), running the network no deeper than
        the deepest of them: block 8 of 12 costs 9/12 of a full forward pass."""
        chosen = self.resolve_layers(layers)
        if chosen is None:
            chosen = [self.depth - 1]
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
            raise InvalidOptionError(f"pixel_values must be [B, 3, H, W], got {list(pixel_values.shape)}")
        grid = self.check_pixel_size(int(pixel_values.shape[2]), int(pixel_values.shape[3]))
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)  # [B, 3, H, W]
        kwargs: dict[str, Any] = (
            {"interpolate_pos_encoding": True} if self.spec.needs_interpolate_flag else {}
        )
        blocks = getattr(self._blocks_owner, self._blocks_name)
        wanted = sorted(set(chosen))
        eager = up_to_blocks(self.model, blocks, kwargs, wanted)
        outputs = self._run_pass(("layers", grid, tuple(wanted)), eager, pixel_values, valid, kwargs)
        by_block = dict(zip(wanted, outputs, strict=True))
        with self._autocast():
            return {i: self._split(self._final_norm(by_block[i]), grid, valid) for i in chosen}

    # ------------------------------------------------------------------ graphs
    def use_graphs(self, enabled: bool = True) -> None:
        """Run forward passes as traced TorchScript graphs where they allow it (``vit_backbone.graphs``):
        the GIL is released for the whole pass, so passes in several threads run side by side, and a
        server's Python threads no longer stall them. Off by default: a size is traced (~0.4 s) the second
        time it is seen."""
        self.graphs = ForwardGraphs() if enabled else None

    def _run_pass(
        self,
        what: tuple[Any, ...],
        eager: Pass,
        x: torch.Tensor,
        valid: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, ...]:
        """``eager(x)``'s outputs: from a graph where one serves (built now if its time has come), else
        eagerly under the forward lock (letterboxed batches always: a per-batch mask and position boxes)."""
        if valid is None and self.graphs is not None:
            key = (*what, self.autocast, str(self.device))
            outputs = self.graphs.forward(key, self.model, eager, x, self._autocast, self._forward_lock)
            if outputs is not None:
                return outputs
        with self._forward_lock, self._autocast(), self._letterbox(valid, kwargs):
            return eager(x)

    def pooled(
        self,
        pixel_values: torch.Tensor,
        pooling: Pooling,
        layers: list[int] | None,
        *,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward pass to one pooled feature per image ([b, F] or [b, h, w, F]); stops at the deepest
        requested block unless the pooling needs the model's own head. ``valid`` [b, h, w]: image patches."""
        if is_mirrored(pooling):  # the batch and its mirror image in one pass (vit_backbone.mirror)
            return self.pooled_many(pixel_values, [(pooling, layers)], valid=valid)[0]
        if layers is None or pooling in WHOLE_NETWORK:
            return pool(self.features(pixel_values, layers=layers, valid=valid), pooling, layers)
        return pool_layers(self.layer_features(pixel_values, layers, valid=valid), pooling, layers)

    def pooled_many(
        self,
        pixel_values: torch.Tensor,
        requests: Sequence[tuple[Pooling, Sequence[int] | None]],
        *,
        valid: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Several (pooling, layers) features from ONE forward pass (an embedding plus head inputs)."""
        return pooled_many(self, pixel_values, requests, valid=valid)

    def _split(
        self, tokens: torch.Tensor, grid: tuple[int, int], valid: torch.Tensor | None = None
    ) -> LayerTokens:
        batch, _, dim = tokens.shape  # [B, P + h*w, D]
        cls = tokens[:, 0] if self.spec.has_cls else None  # [B, D]
        start = int(self.spec.has_cls)
        registers = tokens[:, start : start + self.num_registers]  # [B, R, D]
        patches = tokens[:, self.prefix_tokens :].reshape(batch, grid[0], grid[1], dim)  # [B, h, w, D]
        if valid is not None:
            if tuple(valid.shape) != (batch, *grid):
                want = [batch, *grid]
                raise InvalidOptionError(f"valid must be [B, h, w] = {want}, got {list(valid.shape)}")
            valid = valid.to(device=tokens.device)  # [B, h, w]
        return LayerTokens(cls=cls, registers=registers, patches=patches, valid=valid)

    # ------------------------------------------------------------------ images → arrays
    def prepare(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        size: SizeChoice | None = None,
        policy: ResizePolicy | None = None,
        draft: bool = True,
        preset: str | None = None,
    ) -> list[Prepared]:
        """Decode and preprocess; ``size`` and ``policy`` not given come from ``preset`` (None: this
        backbone's defaults)."""
        return self._prepare(images, self.check_policy(policy, preset), self.choose_size(size, preset), draft)

    def _prepare(
        self,
        images: ImageInput | Sequence[ImageInput],
        policy: ResizePolicy,
        size: tuple[int, int] | None,  # resolved: None is the native box
        draft: bool,
    ) -> list[Prepared]:
        items = [images] if isinstance(images, Image.Image | bytes) else list(images)
        return [self.preprocessor(item, policy=policy, size=size, draft=draft) for item in items]

    def check_policy(self, policy: str | None, preset: str | None = None) -> ResizePolicy:
        return check_policy(policy or self.preset_defaults(preset).policy)

    def pool(self, features: Features, pooling: Pooling, layers: list[int] | None) -> torch.Tensor:
        return pool(features, pooling, layers)

    def embed_prepared(
        self,
        prepared: Sequence[Prepared],
        *,
        pooling: Pooling | None = None,
        layers: LayersArg = None,
        normalize: bool = False,
        batch_size: int = 8,
    ) -> np.ndarray:
        """Embed already-preprocessed images; items with different grids run in separate forwards."""
        chosen_pooling, chosen_layers = self.choose(pooling, layers)
        if batch_size < 1:
            raise InvalidOptionError("batch_size must be at least 1")
        grids = {p.grid for p in prepared}
        if chosen_pooling == "patch" and len(grids) > 1:
            raise InvalidOptionError(
                f"pooling='patch' returns one grid per image, and these images have {len(grids)} different "
                f"grids {sorted(grids)}: use a fixed-size policy (crop, squash, pad) or embed them separately"
            )
        results: list[np.ndarray] = [np.zeros(0, np.float32)] * len(prepared)
        for indices in batches_by_grid(prepared, batch_size):
            batch = [prepared[i] for i in indices]
            pixel_values, _ = stack(batch)  # [b, 3, H, W]
            valid = stack_valid(batch)  # [b, h, w] or None
            pooled = self.pooled(pixel_values, chosen_pooling, chosen_layers, valid=valid)
            for row, index in zip(pooled_array(pooled, normalize), indices, strict=True):  # [F] / [h, w, F]
                results[index] = row
        if not results:
            return np.zeros((0, self.output_dim(chosen_pooling, chosen_layers)), dtype=np.float32)
        return np.stack(results)

    def embed(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        pooling: Pooling | None = None,
        layers: LayersArg = None,
        size: SizeChoice | None = None,
        policy: ResizePolicy | None = None,
        normalize: bool = False,
        batch_size: int = 8,
        draft: bool = True,
        preset: str | None = None,
    ) -> np.ndarray:
        """PIL images or encoded bytes → float32 array [B, F] ([B, h, w, F] for ``patch``), input order.
        Options not given come from ``preset`` (vit_backbone.presets; None: this backbone's defaults)."""
        return self.embed_result(
            images,
            pooling=pooling,
            layers=layers,
            size=size,
            policy=policy,
            normalize=normalize,
            batch_size=batch_size,
            draft=draft,
            preset=preset,
        ).vectors

    def embed_result(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        pooling: Pooling | None = None,
        layers: LayersArg = None,
        size: SizeChoice | None = None,
        policy: ResizePolicy | None = None,
        normalize: bool = False,
        batch_size: int = 8,
        draft: bool = True,
        preset: str | None = None,
    ) -> EmbedResult:
        """``embed`` with the effective grid of every image and the provenance of the vectors."""
        defaults = self.preset_defaults(preset)
        chosen_policy = self.check_policy(policy, preset)
        chosen_pooling, chosen_layers = self.choose(pooling, layers, preset)
        size = self.choose_size(size, preset, chosen_pooling)
        prepared = self._prepare(images, chosen_policy, size, draft)
        vectors = self.embed_prepared(
            prepared, pooling=chosen_pooling, layers=chosen_layers, normalize=normalize, batch_size=batch_size
        )
        return EmbedResult(
            vectors=vectors,
            grids=[p.grid for p in prepared],
            valid=[p.validity() for p in prepared],
            model=self.checkpoint.name,
            revision=self.checkpoint.revision,
            preprocess_hash=self.preprocess_config.hash(),
            pooling=chosen_pooling,
            layers=chosen_layers,
            policy=chosen_policy,
            size=size,
            normalized=normalize,
            interpolation=self.info_interpolation,
            preset=defaults.preset,
        )

    @property
    def facts(self) -> CheckpointFacts:
        return CheckpointFacts(self.checkpoint.revision, self.preprocess_config.hash())

    @property
    def info_interpolation(self) -> str:
        return self.interpolation if self.spec.pos_embed == "learned" else "rope"

    def output_dim(self, pooling: Pooling, layers: list[int] | None) -> int:
        if pooling == "projection" and self.projection is not None:
            return self.projection.dim or self.dim
        return pooled_dim(pooling, self.dim, 1 if layers is None else len(layers))

    # ------------------------------------------------------------------ facts
    def info(self) -> BackboneInfo:
        return backbone_info(self)
