"""Served indexes: binding every ``--index`` to the served model that embeds its queries at start-up, and
binding it again when its table is rebuilt under the running server (hot swap). No HTTP here:
``server/index_access.py`` maps table changes to statuses and ``server/routes_search.py`` serves queries.

An index is served only with a model that can embed its queries: at start-up every ``--index`` is matched
to a served model by revision and preprocessing hash (the table's ``model`` name breaks ties), and a table
that no served model matches stops start-up with what is served and what the table needs.

A table changed under the running server is never searched with stale options: a rebuilt table is reopened
and bound again before the next request uses it (``SearchState.current``), with the new table's embedding
options; while no served model can query it, the old binding stays and the search answers 409/503.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vit_backbone.catalog.index_search import IndexChangedError, IndexDroppedError, SimilarityIndex
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.checkpoint import CheckpointFacts, checkpoint_facts, models_matching
from vit_backbone.errors import SizeError, VitEmbedError
from vit_backbone.preprocess import check_token_budget
from vit_backbone.preprocess_config import literal_size
from vitembed.engine.request_types import EmbedOptions
from vitembed.settings import ServiceSettings, split_index_target
from vitembed.settings_error import SettingsError

if TYPE_CHECKING:
    from vitembed.engine.engine import Engine

log = logging.getLogger("vitembed.search")
SEARCH_THREADS = 2  # LanceDB queries at once; more wait their turn (within the request deadline)


@dataclass(frozen=True)
class ServedIndex:
    name: str
    index: SimilarityIndex
    model: str  # the served model that embeds this index's query images
    options: EmbedOptions  # the table's embedding options
    model_precision: str | None = None  # the served model's compute precision


@dataclass
class SearchState:
    """The served indexes and the bounded pool their searches run on; closed with the app."""

    indexes: dict[str, ServedIndex] = field(default_factory=dict)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(SEARCH_THREADS, thread_name_prefix="search")
    )
    rebind: Callable[[str], ServedIndex] | None = None  # reopens and binds one index again (hot swap)
    _swap_lock: threading.Lock = field(default_factory=threading.Lock)
    _unservable: dict[str, str] = field(default_factory=dict)  # the last reason logged, per index

    def current(self, name: str) -> ServedIndex:
        """The served index ``name``, reopened and bound again if its table was rebuilt or recreated since
        it was opened; unchanged (the search then answers 409/503) while the table cannot be served. One
        schema read when nothing changed; blocking I/O (call it on the search pool)."""
        served = self.indexes[name]
        try:
            served.index.check_current()
            return served
        except (IndexChangedError, IndexDroppedError):
            if self.rebind is None:
                return served
        with self._swap_lock:
            if self.indexes[name] is not served:  # another request swapped it meanwhile
                return self.indexes[name]
            try:
                fresh = self.rebind(name)
            except (VitEmbedError, ValueError, OSError, RuntimeError) as exc:
                if self._unservable.get(name) != str(exc):
                    self._unservable[name] = str(exc)
                    log.warning("index %s changed and cannot be served as it is now: %s", name, exc)
                return served
            self.indexes[name] = fresh
            self._unservable.pop(name, None)
        log.info("index %s: its table was rebuilt; serving the new version (model %s)", name, fresh.model)
        return fresh

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def open_index(name: str, target: str) -> SimilarityIndex:
    db, table = split_index_target(target)
    try:
        return SimilarityIndex.open(db, table)
    except VitEmbedError as exc:
        raise SettingsError(f"--index {name}={target}: {exc}") from exc


def match_model(name: str, meta: CatalogMeta, served: dict[str, CheckpointFacts]) -> str:
    """The served model whose (revision, preprocess hash) equals the table's; its own name first."""
    fits = models_matching(served, meta.revision, meta.preprocess_hash)
    if not fits:
        have = "; ".join(
            f"{model} (revision {rev}, preprocess {pre})" for model, (rev, pre) in served.items()
        )
        raise SettingsError(
            f"index {name!r} was embedded with model {meta.model!r} (revision {meta.revision}, preprocess "
            f"{meta.preprocess_hash}), which is not served; served: {have}. Serve that checkpoint with "
            f"--model, or rebuild the index with a served model"
        )
    return meta.model if meta.model in fits else fits[0]


def preflight_indexes(settings: ServiceSettings) -> None:
    """Before any weights load: every index opens and matches a served model (read from the checkpoints'
    files); raises SettingsError (exit status 2) otherwise."""
    served: dict[str, CheckpointFacts] = {}
    for model, target in settings.models.items():
        try:
            served[model] = checkpoint_facts(target, settings.cache_dir)
        except VitEmbedError:
            continue  # the engine reports an unloadable model itself
    for name, target in settings.indexes.items():
        match_model(name, open_index(name, target).meta, served)


def load_indexes(settings: ServiceSettings, engine: Engine) -> SearchState:
    """Open every configured index and bind it to the loaded model that embeds its queries; an index whose
    size would exceed the server's token limit stops start-up, and one whose vectors were made in another
    precision than the served model's is logged (bfloat16 and float32 vectors stay within cosine 0.999, so
    it is served, but scores of an image's own row fall slightly below 1). The state binds an index again
    the same way when its table is rebuilt (hot swap)."""
    loaded = {name: _bind(settings, engine, name, target) for name, target in settings.indexes.items()}
    return SearchState(loaded, rebind=lambda name: _bind(settings, engine, name, settings.indexes[name]))


def _bind(settings: ServiceSettings, engine: Engine, name: str, target: str) -> ServedIndex:
    infos = engine.model_infos()
    served = {model: engine.backbone(model).facts for model in infos}
    index = open_index(name, target)
    meta = index.meta
    model = match_model(name, meta, served)
    if meta.size is not None:
        patch_h, patch_w = infos[model]["patch_size"]
        try:
            check_token_budget(
                (meta.size[0] // patch_h, meta.size[1] // patch_w),
                settings.max_tokens_per_image,
                f"index {name!r} was embedded at size {meta.size[0]}x{meta.size[1]}, which",
                "raise the limit (VITEMBED_MAX_TOKENS_PER_IMAGE) or rebuild the index at a smaller size",
            )
        except SizeError as exc:
            raise SettingsError(str(exc)) from exc
    choice = engine.precision(model)
    precision, described = choice.label, choice.describe()
    if meta.precision is not None and meta.precision != precision:
        log.warning(
            "index %s holds vectors made in %s but model %s runs in %s: its queries are embedded in %s "
            "(scores of identical images may fall slightly below 1)",
            name, meta.precision, model, described, precision,
        )  # fmt: skip
    options = EmbedOptions(
        pooling=meta.pooling,
        layers=None if meta.layers is None else tuple(meta.layers),
        size=literal_size(meta.size),  # null: the native box, whatever the current preset's
        policy=meta.policy,
        normalize=meta.normalized,
    )
    return ServedIndex(name, index, model, options, precision)
