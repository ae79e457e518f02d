"""The engine with a real tiny checkpoint: batching across requests, parity with the library, errors."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch
from PIL import Image
from vitembed.engine import served_model
from vitembed.engine.admission import Reservation
from vitembed.engine.engine import (
    EmbedOptions,
    Engine,
    NotReadyError,
    RequestImageError,
    RequestTicket,
)
from vitembed.engine.precision_cache import CACHE_FILE
from vitembed.engine.served_model import ingest_share
from vitembed.engine.threads import configure_threads, forward_plan
from vitembed.engine.wait_estimates import IngestEstimate
from vitembed.metrics import Metrics
from vitembed.settings import ServiceSettings

from vit_backbone import InvalidOptionError, ModelNotFoundError, SizeError, load_backbone
from vit_backbone.backbone import Backbone
from vit_backbone.cpu_quota import available_cpus


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def metric(engine: Engine, name: str) -> float:
    text = engine.metrics.render()[0].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, Path]) -> Iterator[Engine]:
    settings = ServiceSettings(
        models={"tiny": str(tiny_checkpoints["dinov2"])}, max_wait_ms=20, precision="float32"
    )
    eng = Engine(settings, Metrics())
    eng.start()
    yield eng
    eng.stop()


async def embed(engine: Engine, images: list[bytes], **options: object) -> np.ndarray:
    deadline = time.monotonic() + 30
    outcome = await engine.embed(
        "tiny",
        images,
        EmbedOptions(**options),
        ticket=RequestTicket(deadline),
        deadline=deadline,  # type: ignore[arg-type]
    )
    return outcome.vectors


def test_concurrent_requests_share_forward_passes_and_equal_the_library(
    engine: Engine, tiny_checkpoints: dict[str, Path]
) -> None:
    images = [jpeg(200 + 5 * i, 150 + 3 * i, i) for i in range(32)]
    before = metric(engine, "vitembed_forward_passes_total")

    async def run() -> list[np.ndarray]:
        return await asyncio.gather(
            *(embed(engine, [image], pooling="mean", normalize=True) for image in images)
        )

    rows = np.concatenate(asyncio.run(run()))
    passes = metric(engine, "vitembed_forward_passes_total") - before
    assert passes < 32
    expected = load_backbone(tiny_checkpoints["dinov2"]).embed(images, pooling="mean", normalize=True)
    np.testing.assert_allclose(rows, expected, atol=1e-5)


def test_the_lease_of_an_early_check_is_given_back_by_the_same_requests_admission(engine: Engine) -> None:
    """The place ``refuse_early(lease=True)`` holds while a body is read is traded by that request's own
    admission (same task), not left to lapse after LEASE_S while the request also holds a reservation."""
    load = engine._get("tiny").load

    async def request() -> tuple[int, int]:
        engine.refuse_early("tiny", time.monotonic() + 30, lease=True)
        during = len(load._leases)
        await embed(engine, [jpeg(64, 64, 0)])
        return during, len(load._leases)

    async def other_task_checks_only() -> int:
        await asyncio.to_thread(engine.refuse_early, "tiny", time.monotonic() + 30, lease=True)
        await embed(engine, [jpeg(64, 64, 1)])  # this task holds no lease of its own to give back
        return len(load._leases)

    assert asyncio.run(request()) == (1, 0)
    assert asyncio.run(other_task_checks_only()) == 1  # the thread's lease is not this task's: it lapses
    load._leases.clear()


def test_admission_learns_the_decode_cost_and_counts_no_decode_once_requests_end(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode's CPU time feeds the model's ingest estimate and marks its image decoded; a request that
    succeeded or failed leaves no image counted as still to be decoded. The share of the decode that counts
    follows the cores torch leaves free; ``admission_counts_decode=false`` or an accelerator turns it off."""
    served = engine._get("tiny")
    load = served.load
    decoded: list[int] = []
    mark = Reservation.decoded
    monkeypatch.setattr(Reservation, "decoded", lambda self: (decoded.append(self.remaining), mark(self)))
    load.ingest = IngestEstimate()  # the start-up seed forgotten: only this request's decodes
    asyncio.run(embed(engine, [jpeg(640, 480, 3), jpeg(320, 240, 4)]))
    assert decoded == [2, 2]  # each image marked once, before either reached a forward pass
    assert load.ingest.per_image_s > 0 and load._undecoded == 0
    with pytest.raises(RequestImageError):
        asyncio.run(embed(engine, [jpeg(64, 64, 5), b"not an image"]))
    assert load._undecoded == 0 and engine.admission.held == 0
    workers = len(served.batcher._threads)
    free = available_cpus() - workers * torch.get_num_threads()
    assert load.ingest_share == max(0, 2 - max(0, free)) / 2  # the fixture's 2 decode workers
    assert load.workers == workers
    settings = ServiceSettings(decode_workers=2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: available_cpus())
    assert ingest_share(served.backbone, settings) == 1.0
    assert ingest_share(served.backbone, ServiceSettings(admission_counts_decode=False)) == 0.0
    monkeypatch.setattr(served_model, "available_cpus", lambda: torch.get_num_threads() + 1)
    assert ingest_share(served.backbone, settings) == 0.5  # one decode worker finds a free core
    monkeypatch.setattr(served_model, "available_cpus", lambda: torch.get_num_threads() + 4)
    assert ingest_share(served.backbone, settings) == 0.0
    # two forward threads of one torch thread each on 2 cores leave no core free
    monkeypatch.setattr(served_model, "available_cpus", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert ingest_share(served.backbone, settings, forward_workers=2) == 1.0
    assert ingest_share(served.backbone, settings, forward_workers=1) == 0.5
    on_an_accelerator = cast(Backbone, SimpleNamespace(device=torch.device("meta")))  # all it reads
    assert ingest_share(on_an_accelerator, settings) == 0.0


def test_a_bad_image_names_its_index_and_costs_no_forward_pass(engine: Engine) -> None:
    before = metric(engine, "vitembed_forward_passes_total")
    good = jpeg(100, 100, 1)
    with pytest.raises(RequestImageError) as failed:
        asyncio.run(embed(engine, [good, good[: len(good) // 2], b"not an image"]))
    assert failed.value.index == 1 and failed.value.error.code == "truncated"
    with pytest.raises(RequestImageError) as failed:
        asyncio.run(embed(engine, [good, good, b"not an image"]))
    assert failed.value.index == 2 and failed.value.error.code == "not_an_image"
    assert metric(engine, "vitembed_forward_passes_total") == before
    assert asyncio.run(embed(engine, [good])).shape == (1, 32)  # the next good request works at once


def test_options_are_checked_before_any_decoding(engine: Engine) -> None:
    with pytest.raises(InvalidOptionError, match="unknown pooling"):
        asyncio.run(embed(engine, [b"never decoded"], pooling="max"))
    with pytest.raises(InvalidOptionError, match="has 2 blocks"):
        asyncio.run(embed(engine, [b"never decoded"], layers=(7,)))
    with pytest.raises(ModelNotFoundError, match="'other' is not served"):
        deadline = time.monotonic() + 5
        asyncio.run(
            engine.embed("other", [], EmbedOptions(), ticket=RequestTicket(deadline), deadline=deadline)
        )


def test_token_limit_per_image(tiny_checkpoints: dict[str, Path]) -> None:
    settings = ServiceSettings(models={"tiny": str(tiny_checkpoints["dinov2"])}, max_tokens_per_image=20)
    eng = Engine(settings, Metrics())
    with pytest.raises(NotReadyError):
        asyncio.run(embed(eng, [jpeg(64, 64, 0)]))
    eng.start()
    try:
        assert asyncio.run(embed(eng, [jpeg(64, 64, 0)], policy="squash", size=(56, 56))).shape == (1, 32)
        with pytest.raises(
            SizeError, match="size 112x112 gives 64 patch tokens, over the server's limit of 20"
        ):
            asyncio.run(embed(eng, [b"never decoded"], policy="squash", size=(112, 112)))
    finally:
        eng.stop()


def test_forced_bfloat16_stays_close_to_float32(tiny_checkpoints: dict[str, Path]) -> None:
    settings = ServiceSettings(models={"tiny": str(tiny_checkpoints["dinov2"])}, precision="bfloat16")
    eng = Engine(settings, Metrics())
    eng.start()
    try:
        info = eng.model_infos()["tiny"]
        assert info["precision"] == "bfloat16"  # one value; the measured cosine in its own field
        assert 0.999 <= info["precision_cosine"] <= 1.0 + 1e-6
        images = [jpeg(120, 90, i) for i in range(4)]
        low = asyncio.run(embed(eng, images, normalize=True))
        exact = load_backbone(tiny_checkpoints["dinov2"]).embed(images, normalize=True)
        assert float((low * exact).sum(1).min()) >= 0.999
        assert np.abs(low - exact).max() > 1e-4  # autocast really ran in bfloat16
    finally:
        eng.stop()


@pytest.mark.parametrize(
    ("bf16_over_fp32", "chosen"),
    [(0.5, "bfloat16"), (1.1, "bfloat16"), (1.3, "float32")],  # a noisy tie keeps bf16; a clear loss vetoes
)
def test_auto_precision_follows_cpu_flags_and_vetoes_only_a_clear_slowdown(
    tiny_checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    bf16_over_fp32: float,
    chosen: str,
    tmp_path: Path,
) -> None:
    """The engine uses the shared rule (vit_backbone.precision.choose_autocast) with its timings."""
    import vit_backbone.precision as precision_module

    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda flags=None: True)
    real = precision_module._timed_embed

    def timed(backbone: Backbone, *args: object) -> tuple[np.ndarray, float]:
        vectors, _ = real(backbone, *args)  # type: ignore[arg-type]
        return vectors, (bf16_over_fp32 if backbone.autocast is not None else 1.0)

    monkeypatch.setattr(precision_module, "_timed_embed", timed)
    settings = ServiceSettings(models={"tiny": str(tiny_checkpoints["dinov2"])}, cache_dir=tmp_path)
    eng = Engine(settings, Metrics())
    eng.start()
    try:
        assert eng.model_infos()["tiny"]["precision"] == chosen
        assert eng.model_infos()["tiny"]["precision_cosine"] >= 0.999  # measured either way
        served_autocast = eng._served["tiny"].backbone.autocast
        assert served_autocast == (torch.bfloat16 if chosen == "bfloat16" else None)
    finally:
        eng.stop()
    # a restart on this machine class reuses the measured decision: no probe, the same answer
    monkeypatch.setattr(precision_module, "_timed_embed", _no_probe)
    again = Engine(settings, Metrics())
    again.start()
    try:
        assert again.model_infos()["tiny"]["precision"] == chosen
        assert again._served["tiny"].backbone.autocast == served_autocast
    finally:
        again.stop()
    cached = json.loads((tmp_path / CACHE_FILE).read_text())
    assert [entry["label"] for entry in cached.values()] == [chosen]  # keyed by CPU flags + model, one entry


def _no_probe(*args: object) -> None:
    raise AssertionError("the cached precision decision should have been used")


def test_configure_threads_shortens_the_gil_switch_interval() -> None:
    """The forward thread takes the GIL back after every torch op; at Python's default 5 ms switch interval
    each re-take can wait that long behind an event loop busy answering refusals."""
    before_interval, before_threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        sys.setswitchinterval(0.005)
        cpu = torch.device("cpu")
        assert configure_threads(ServiceSettings(torch_threads=1, forward_workers=1), cpu) == 1
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert torch.get_num_threads() == 1
        configure_threads(ServiceSettings(torch_threads=1, gil_switch_interval_ms=2), cpu)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before_interval)
        torch.set_num_threads(before_threads)


def test_the_forward_plan_splits_the_cpus_between_forward_threads() -> None:
    """With graphs on the CPU, one forward thread per usable CPU up to 4, sharing the CPUs' torch threads
    (2 cores: 2 x 1); eager passes or an accelerator: one thread with every CPU; explicit settings win."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    graphs, eager = ServiceSettings(), ServiceSettings(forward_graphs=False)
    assert forward_plan(graphs, cpu, cpus=1) == (1, 1)
    assert forward_plan(graphs, cpu, cpus=2) == (2, 1)
    assert forward_plan(graphs, cpu, cpus=3) == (3, 1)
    assert forward_plan(graphs, cpu, cpus=16) == (4, 4)
    assert forward_plan(graphs, gpu, cpus=16) == (1, 16)
    assert forward_plan(eager, cpu, cpus=2) == (1, 2)
    assert forward_plan(ServiceSettings(forward_workers=1), cpu, cpus=2) == (1, 2)
    assert forward_plan(ServiceSettings(torch_threads=2), cpu, cpus=2) == (2, 2)


def test_gil_switch_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        ServiceSettings(gil_switch_interval_ms=0)
