"""The one settings class of the service: CLI flags and ``VITEMBED_*`` environment variables.

Built when the app starts (never at import), validated eagerly, so a bad value stops start-up with a
message instead of failing on the first request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vitembed.callers import CallerKeys, load_callers

MiB = 1024 * 1024
HEAD_NAME_MAX = 64  # the longest head name a request may carry (routes_heads: head=, heads=)


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VITEMBED_", extra="forbid", frozen=True)

    # name -> local folder, hub id or "embedded"; env: VITEMBED_MODELS='{"embedded": "embedded"}'
    models: dict[str, str] = Field(default_factory=lambda: {"embedded": "embedded"})
    # similar-item search: name -> "DB_PATH:TABLE"; env: VITEMBED_INDEXES='{"products": "/data/db:products"}'
    indexes: dict[str, str] = Field(default_factory=dict)
    # frozen heads: name -> HEAD.safetensors / HEAD.json / folder; env: VITEMBED_HEADS='{"kind": "/h/kind"}'
    heads: dict[str, str] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    cache_dir: Path | None = None  # where the embedded checkpoint is converted; default ~/.cache/vitembed

    # batching
    # A forward pass takes at most 16 images and at most 8 x 257 tokens (with prefix): eight 224-px DINOv2
    # images (8 beat 16 there by 3 % model-only on this 2-core CPU; a checkpoint with registers or DINOv3's
    # patch 16 has other token counts: 7 or 10 per pass), sixteen of the default preset's mirrored 98-px box
    # (16 beat 8 by 7 % model-only and served ~15 % more under load: fewer GIL hand-offs per image, README
    # "Engine"), one image at 518 px (not measured against 8: attention dominates there)
    max_batch_size: int = Field(16, ge=1, le=1024)
    max_batch_tokens: int = Field(8 * 257, ge=1)
    max_wait_ms: float = Field(5.0, ge=0, le=10_000)
    queue_size: int = Field(256, ge=1)  # images waiting for a forward pass, all models together (hard cap)
    # admit a request only if its images are predicted to be served within this (and its own deadline)
    queue_delay_target_s: float = Field(2.0, gt=0, le=3600)
    decode_workers: int = Field(2, ge=1, le=64)
    request_timeout_s: float = Field(30.0, gt=0)
    # connections: requests in flight before 503 server_busy; a body must arrive within body_timeout_s of the
    # request's start (else 408); a connection must send a request head within header_timeout_s (else closed)
    max_concurrent_requests: int = Field(512, ge=1)
    body_timeout_s: float = Field(30.0, gt=0)
    header_timeout_s: float = Field(10.0, gt=0)
    # a connection refused on its request head is read again only once the Retry-After it was given has
    # passed: clients that ignore Retry-After wait for it instead of costing a refusal per round trip
    enforce_retry_after: bool = True
    # refusals get Retry-After values spread over whole seconds, so that a crowd of refused callers comes back
    # at about twice the model's throughput instead of all in the next second (engine/admission.py)
    spread_retry_after: bool = True
    # admission counts the decode still ahead of the queue (images leased on request heads or waiting for the
    # decode pool) on a CPU model, for the decode workers that find no core torch leaves free: the decode
    # takes its CPU time from the forward pass (engine/admission.py, engine/served_model.ingest_share)
    admission_counts_decode: bool = True

    # precision: "auto" = bfloat16 autocast where the CPU has native bf16 (AMX / AVX512-BF16) or on CUDA,
    # kept only if warm-up embeddings stay within cosine 0.999 of float32
    device: str = "auto"  # the CLI's default everywhere (serve, embed-catalog): CUDA when available
    precision: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    torch_threads: int | None = Field(
        None, ge=1
    )  # per forward thread; default: usable CPUs / forward_workers
    # forward passes as traced TorchScript graphs where they allow it (vit_backbone.graphs): the GIL is
    # released for the whole pass, so the forward threads run side by side and the event loop and decode
    # workers no longer stall them at every torch op
    forward_graphs: bool = True
    # forward threads per model; 0 = auto: on the CPU with graphs, one per usable CPU up to 4, each with
    # (CPUs / threads) torch threads (2 cores: 2 threads of 1: 92 images/s model-only against 72 for one
    # thread of 2, and no OpenMP barrier between the cores for another thread's work to stall; README,
    # "Engine"); otherwise 1
    forward_workers: int = Field(0, ge=0, le=64)
    # the forward threads' nice value above the process's (Linux): with no other process on the machine, 10
    # halved the 429 p99 under overload at the same goodput, but beside a process spinning on one core the
    # forward threads then lost that core to it (capacity 37 against 51 images/s): 0 by default (README)
    forward_nice: int = Field(0, ge=0, le=19)
    # the event-loop thread's nice value below the process's (Linux; `vitembed serve`): it reads every request
    # head and answers every refusal, and waits less behind the always-runnable forward threads; it needs
    # CAP_SYS_NICE or an RLIMIT_NICE that allows it (--ulimit nice=25), else one log line and no change.
    # Measured under overload (README): 429 p99 after the first second 30-36 against 51-77 ms for 256
    # well-behaved clients, at the same goodput, with or without a busy neighbour. 0: unchanged
    event_loop_priority: int = Field(5, ge=0, le=20)
    # how long a Python thread may hold the GIL while another waits for it (sys.setswitchinterval). The
    # forward thread takes the GIL back after every torch op; under overload the event loop holds it answering
    # refusals, and at Python's default 5 ms each re-take can wait that long: a forward pass measured 2.1 s
    # instead of 0.65 s beside a busy Python thread, 0.78 s at 0.5 ms (README, "Admission and safety")
    gil_switch_interval_ms: float = Field(0.5, gt=0, le=100)
    # freeze the start-up heap out of the cyclic GC's reach once the app is ready: a full collection walks
    # it holding the GIL (~0.1 s on 2 cores), which stalls the event loop and the forward thread alike
    # (gc_heap.py)
    gc_freeze: bool = True
    # the youngest GC generation is collected after this many net allocations of tracked objects (Python's
    # default: 700; 0 keeps Python's). Under overload the live set is large (hundreds of requests in flight
    # and connections held), so each collection of an older generation walks it: at 700 the open loop spent
    # 0.034 cores in GC pauses (49 generation-1 pauses of ~8 ms and 4 generation-2 pauses of ~35 ms per
    # 20 s), at 10,000 0.008 cores (7-9 young pauses of 12-25 ms, no older ones)
    # (bench/results/overload-history.md)
    gc_young_threshold: int = Field(10_000, ge=0)

    # limits
    max_body_bytes: int = Field(32 * MiB, ge=1024)
    max_images_per_request: int = Field(64, ge=1)
    max_image_pixels: int = Field(40_000_000, ge=1)
    max_aspect_ratio: float = Field(20.0, ge=1.0)
    max_tokens_per_image: int = Field(4096, ge=1)  # refuse sizes whose grid exceeds this (cost ~ tokens²)
    # /v1/classify upsample=true: mask pixels (H x W summed over the request's images) one answer may carry
    max_upsample_pixels: int = Field(16_000_000, ge=1)

    api_key: str | None = None  # bearer token for /v1/*; None = no auth (with a keys file: caller "default")
    # JSON file of callers: name -> {"key" | "key_sha256", optional quotas}; see vitembed/callers.py
    api_keys_file: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    _callers: CallerKeys = PrivateAttr(default_factory=CallerKeys)  # read from api_key + api_keys_file

    @field_validator("models")
    @classmethod
    def _models_not_empty(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("serve at least one model (--model NAME=PATH_OR_ID)")
        for name in value:
            if not name or "/" in name or name.strip() != name:
                raise ValueError(f"model name {name!r} must be non-empty, without '/' or surrounding spaces")
        return value

    @field_validator("indexes")
    @classmethod
    def _indexes_well_formed(cls, value: dict[str, str]) -> dict[str, str]:
        for name, target in value.items():
            if not name or "/" in name or name.strip() != name:
                raise ValueError(f"index name {name!r} must be non-empty, without '/' or surrounding spaces")
            split_index_target(target)
        return value

    @field_validator("heads")
    @classmethod
    def _head_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not name or name.strip() != name or "/" in name or "," in name or not path:
                raise ValueError(f"head {name!r}: a name without '/', ',' or surrounding spaces, and a path")
            if len(name) > HEAD_NAME_MAX:
                raise ValueError(
                    f"head name {name[:HEAD_NAME_MAX]!r}... is {len(name)} characters long; requests name "
                    f"heads with at most {HEAD_NAME_MAX}: choose a shorter name"
                )
        return value

    @model_validator(mode="after")
    def _batch_fits_queue(self) -> ServiceSettings:
        if self.max_images_per_request > self.queue_size:
            raise ValueError(
                f"max_images_per_request ({self.max_images_per_request}) exceeds queue_size "
                f"({self.queue_size}): such a request could never be admitted"
            )
        return self

    @model_validator(mode="after")
    def _read_callers(self) -> ServiceSettings:
        self._callers = load_callers(self.api_keys_file, self.api_key)
        return self

    @property
    def callers(self) -> CallerKeys:
        """The accepted keys and their callers (``keyed`` false: no auth)."""
        return self._callers


def parse_model_args(values: list[str]) -> dict[str, str]:
    """``--model NAME=PATH_OR_ID`` (repeatable); a bare ``PATH`` is named after its folder."""
    models: dict[str, str] = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep:
            target = value
            name = Path(value.rstrip("/")).name or value
        if not name or not target:
            raise ValueError(f"--model {value!r}: expected NAME=PATH_OR_ID or PATH")
        if name in models:
            raise ValueError(f"--model: the name {name!r} is given twice")
        models[name] = target
    return models


def split_index_target(target: str) -> tuple[str, str]:
    """``DB_PATH:TABLE`` → (database folder, table name); the last ``:`` separates them."""
    db, sep, table = target.rpartition(":")
    if not sep or not db or not table or "/" in table:
        raise ValueError(f"index {target!r}: expected DB_PATH:TABLE, e.g. /data/lancedb:products")
    return db, table


def parse_index_args(values: list[str]) -> dict[str, str]:
    """``--index NAME=DB_PATH:TABLE`` (repeatable)."""
    indexes: dict[str, str] = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep or not name or not target:
            raise ValueError(f"--index {value!r}: expected NAME=DB_PATH:TABLE")
        if name in indexes:
            raise ValueError(f"--index: the name {name!r} is given twice")
        split_index_target(target)
        indexes[name] = target
    return indexes
