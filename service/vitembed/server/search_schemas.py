"""The request and response models of ``POST /v1/search`` and ``GET /v1/indexes`` (and the OpenAPI body of
the search, whose images are parsed by hand)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vit_backbone.catalog.index_search import MAX_K, MAX_NPROBES
from vitembed.server.openapi_bodies import image_request_body, json_images
from vitembed.server.schemas import NOT_BOOL, fold_aliases

MAX_WHERE_CHARS = 1024
SEARCH_FIELDS = ("index", "k", "where", "nprobes", "threshold")


class SearchOptionsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str | None = Field(
        None, min_length=1, max_length=128, description="a served index (default: the only one)"
    )
    k: Annotated[int, NOT_BOOL] = Field(
        10, ge=1, le=MAX_K, description=f"results per query, 1..{MAX_K} (alias: top_k)"
    )
    where: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_WHERE_CHARS,
        description="SQL predicate on the index's metadata columns, applied before the search",
    )
    nprobes: Annotated[int | None, NOT_BOOL] = Field(
        None,
        ge=1,
        le=MAX_NPROBES,
        description="IVF partitions an ANN search visits (default: 10% of them, at least 20)",
    )
    threshold: Annotated[float | None, NOT_BOOL] = Field(
        None,
        ge=-1e30,
        le=1e30,
        description="keep only hits scoring at least this (near-duplicate check: `vitembed dedup`'s "
        "calibrated cosine); each query then says whether any hit is left (`near_duplicate`)",
    )

    @model_validator(mode="before")
    @classmethod
    def _top_k_is_k(cls, data: Any) -> Any:
        return fold_aliases(data)


class SearchJsonRequest(SearchOptionsIn):
    images: list[dict[str, Any]] | None = Field(None, description='[{"base64": "..."}], one query per image')
    vector: list[float] | None = Field(None, description="one query vector instead of images")


class HitOut(BaseModel):
    id: str
    score: float = Field(description="similarity under the index's metric (cosine or dot): higher is closer")
    metadata: dict[str, str | None]


class QueryResultOut(BaseModel):
    index: int = Field(description="0-based position of the query")
    results: list[HitOut]
    near_duplicate: bool | None = Field(None, description="with threshold: any hit scores at least it")


class SearchProvenance(BaseModel):
    index: str
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None
    size: list[int] | None
    policy: str
    preset: str | None = Field(
        None, description="the named defaults the index was built with; null: before presets"
    )
    normalized: bool
    metric: str
    ann: bool
    precision: str | None = Field(
        description="of the query embedding (float32, bfloat16 or float16); null for vector queries"
    )
    precision_cosine: float | None = Field(
        description="smallest cosine of that precision's vectors to float32's on the start-up probe images"
    )
    model_precision: str | None = Field(
        description="the served model's compute precision (float32, bfloat16 or float16)"
    )
    index_precision: str | None = Field(
        description="the precision the index's vectors were made in; null when the catalog did not record it"
    )


class SearchResponse(BaseModel):
    index: str
    k: int
    threshold: float | None = None
    data: list[QueryResultOut]
    provenance: SearchProvenance


class IndexCard(BaseModel):
    name: str
    model: str
    db: str
    table: str
    rows: int
    metric: str
    ann: bool
    ann_threshold: int
    metadata_columns: list[str]
    meta: dict[str, Any]


class IndexList(BaseModel):
    object: str = "list"
    data: list[IndexCard]


def _search_body() -> dict[str, Any]:
    """Query images as multipart parts or JSON ``images``, or one JSON ``vector``: exactly one of them."""
    body = image_request_body(SearchOptionsIn)
    schema = body["content"]["application/json"]["schema"]
    schema["required"] = []
    schema["properties"]["images"] = {"anyOf": [json_images(), {"type": "null"}]}
    schema["properties"]["vector"] = {
        "anyOf": [{"type": "array", "items": {"type": "number"}, "minItems": 1}, {"type": "null"}],
        "description": "one query vector instead of images (the index's width)",
    }
    schema["oneOf"] = [
        {"required": [name], "properties": {name: {"type": "array"}}} for name in ("images", "vector")
    ]
    return body


SEARCH_BODY = _search_body()
