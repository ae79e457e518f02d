"""A checkpoint's ``config.json`` read the way its transformers config class reads it.

transformers 4.x ``save_pretrained`` writes only the values that differ from the config class's defaults (a
full CLIP checkpoint saved that way has ``"vision_config": {"model_type": "clip_vision_model",
"patch_size": 16}``), so every field the library reads takes the family's default when it is absent. The
defaults are a table per family (``FamilySpec.config_defaults``) rather than transformers' config classes
themselves: importing one of those imports torch (seconds), which ``vitembed inspect`` must not pay; a test
holds every table equal to its class. A field that is null or of the wrong type is a
:class:`~vit_backbone.errors.ModelLoadError` naming the file and the field, never a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .specs import FamilySpec


@dataclass(frozen=True)
class ModelConfig:
    """The vision tower's config with its family's defaults filled in, plus where it was read from."""

    spec: FamilySpec
    raw: Mapping[
        str, Any
    ]  # config.json as written (the whole dual encoder for a full CLIP/SigLIP checkpoint)
    values: Mapping[str, Any]  # the vision tower's fields: what the file says over the family's defaults
    source: str  # the file, for messages
    prefix: str = ""  # "vision_config." when the tower's fields are nested (a dual encoder's config)

    def check(self) -> ModelConfig:
        """Read every field the library uses, so that an unusable config fails here, before any weights
        load, with a :class:`ModelLoadError` naming the file and the field."""
        _ = (self.patch_size, self.native_grid, self.heads, self.depth, self.channels, self.prefix_tokens)
        self.spec.arch_fields(self, None)
        return self

    # ------------------------------------------------------------------ typed fields
    def get(self, key: str) -> Any:
        return self.values.get(key)

    def integer(self, key: str) -> int:
        value = self._present(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"must be an integer, got {value!r}")
        return value

    def positive_integer(self, key: str) -> int:
        value = self.integer(key)
        if value <= 0:
            raise self.error(key, f"must be a positive integer, got {value}")
        return value

    def flag(self, key: str) -> bool:
        value = self._present(key)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def number(self, key: str) -> float:
        value = self._present(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def pair(self, key: str) -> tuple[int, int]:
        """An int (square) or a pair of ints, as transformers takes ``image_size`` and ``patch_size``."""
        value = self._present(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, value
        if (
            isinstance(value, list | tuple)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            return int(value[0]), int(value[1])
        raise self.error(key, f"must be a positive int or a pair of ints, got {value!r}")

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(
            f"field {self.prefix}{key!s} {problem}", path=self.source, field=self.prefix + key
        )

    def _present(self, key: str) -> Any:
        if key not in self.values:  # a field the family's defaults do not know: a gap in the spec
            raise self.error(key, f"is missing and {self.spec.name} has no default for it")
        value = self.values[key]
        if value is None:
            raise self.error(key, "is null")
        return value

    # ------------------------------------------------------------------ the facts every family has
    @property
    def patch_size(self) -> tuple[int, int]:
        return self.pair("patch_size")

    @property
    def image_size(self) -> tuple[int, int]:
        return self.pair("image_size")

    @property
    def native_grid(self) -> tuple[int, int]:
        """The patch grid of the configured image size (what a learned position table was trained for)."""
        (height, width), (patch_h, patch_w) = self.image_size, self.patch_size
        if height < patch_h or width < patch_w:
            raise self.error("image_size", f"{height}x{width} is smaller than the {patch_h}x{patch_w} patch")
        return height // patch_h, width // patch_w

    @property
    def dim(self) -> int:
        return self.positive_integer("hidden_size")

    @property
    def depth(self) -> int:
        return self.positive_integer("num_hidden_layers")

    @property
    def heads(self) -> int:
        heads = self.positive_integer("num_attention_heads")
        if self.dim % heads:
            raise self.error("num_attention_heads", f"must divide hidden_size {self.dim}, got {heads}")
        return heads

    @property
    def channels(self) -> int:
        return self.positive_integer("num_channels")

    @property
    def num_registers(self) -> int:
        if "num_register_tokens" not in self.spec.config_defaults:
            return 0
        registers = self.integer("num_register_tokens")
        if registers < 0:
            raise self.error("num_register_tokens", f"must be >= 0, got {registers}")
        return registers

    @property
    def prefix_tokens(self) -> int:
        """Tokens before the patches: CLS (if the family has one) plus registers."""
        return int(self.spec.has_cls) + self.num_registers

    @property
    def weights_prefix(self) -> str:
        """Where the tower's weights sit in the checkpoint: ``vision_model.`` in a whole dual encoder."""
        return self.spec.tower_prefix if self.prefix else ""

    @property
    def architectures(self) -> tuple[str, ...]:
        names = self.raw.get("architectures") or ()
        return tuple(str(name) for name in names) if isinstance(names, list | tuple) else ()
