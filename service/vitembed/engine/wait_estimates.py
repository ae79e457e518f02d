"""What admission predicts waits from: each model's measured cost per image (``ThroughputEstimate``), the CPU
cost of decoding one (``IngestEstimate``) and how far actual waits run past that estimate
(``WaitCalibration``). Pure bookkeeping on numbers given to it;
``admission.ModelLoad`` holds one of each per model and calls them under its lock."""

from __future__ import annotations

from collections import deque

ESTIMATE_WINDOW = 32  # forward passes per token count that the throughput estimate remembers
ESTIMATE_KEYS = 64  # token counts remembered per model (least recently observed forgotten first)
# the wait calibration (``WaitCalibration``): requests predicted to wait less than this are too dominated by
# fixed costs (decode, the response) to say how far the forward-pass estimate is off
CALIBRATION_MIN_PREDICTED_S = 0.5
# the factor tracks this quantile of actual / predicted: the admitted p99 is what must stay within the target
# (A/B of 63a9ee4, bench/results/overload-history.md: 0.9 lowered the admitted p99 of requests sent in time
# at no cost in goodput; 0.95 lowered it more but cost a fifth of the goodput at 256 clients: a shorter queue
# fills smaller batches)
CALIBRATION_QUANTILE = 0.9
CALIBRATION_STEP = 0.05  # relative change of the factor per request that waited longer than it predicted
# how far the factor may scale predictions down and up. Never down: a calm spell (the forward thread alone
# with the GIL, requests finishing faster than the estimate, which lags by its window) pulled the factor to
# 0.8, and a flood arriving next was admitted on that, 40 % past what it could serve within the target
CALIBRATION_BOUNDS = (1.0, 4.0)
INGEST_WINDOW = 64  # decoded images that the ingest estimate averages over


class ThroughputEstimate:
    """Seconds per image of one model, per token count, from its recent forward passes: the window's
    total seconds over its total images (full batches weigh more than lone images, and one slow pass is
    diluted). A token count never measured is scaled linearly from the nearest one measured."""

    def __init__(self, window: int = ESTIMATE_WINDOW) -> None:
        self._window = window
        self._passes: dict[int, deque[tuple[int, float]]] = {}  # tokens -> (images, seconds)
        # tokens -> seconds per image over its window, kept with the window: admission asks for it on every
        # request head and once per leased place, hundreds of times per forward pass under a flood
        self._per_image: dict[int, float] = {}

    def observe(self, tokens: int, images: int, seconds: float) -> None:
        if images < 1 or seconds < 0:
            return
        passes = self._passes.pop(tokens, None) or deque(maxlen=self._window)
        passes.append((images, seconds))
        self._passes[tokens] = passes  # re-inserted: the dict's order is least recently observed first
        self._per_image[tokens] = sum(s for _, s in passes) / sum(n for n, _ in passes)
        while len(self._passes) > ESTIMATE_KEYS:
            del self._per_image[next(iter(self._passes))]
            del self._passes[next(iter(self._passes))]

    def per_image_s(self, tokens: int) -> float | None:
        known = self._per_image.get(tokens)
        if known is not None:
            return known
        if not self._per_image:
            return None
        nearest = min(self._per_image, key=lambda measured: abs(measured - tokens))
        return self._per_image[nearest] * tokens / max(1, nearest)


class IngestEstimate:
    """CPU seconds to decode and preprocess one image (the decode thread's own CPU time, not its wall time,
    which a flood inflates), averaged over the last ``window`` images. A family whose preprocessing runs in
    torch (``preprocess._run_torch``) also spends CPU on the OpenMP workers its resize starts, which a
    thread's own time does not see: its decode cost is undercounted."""

    def __init__(self, window: int = INGEST_WINDOW) -> None:
        self._seconds: deque[float] = deque(maxlen=window)
        self.per_image_s = 0.0

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            return
        self._seconds.append(seconds)
        self.per_image_s = sum(self._seconds) / len(self._seconds)


class WaitCalibration:
    """How much longer admitted requests actually waited than the forward-pass estimate predicted: a
    running estimate of a high quantile of actual / predicted, which scales every prediction.

    The estimate times forward passes only. Under a flood the same machine also decodes, answers
    refusals on the event loop and may share its cores with a neighbour, so a request admitted on a 2 s
    prediction waited 3-5 s (bench/results/overload-history.md). The ratio is measured per request, from
    admission to its last row, against the prediction before calibration (so the factor does not chase
    itself), and only for requests predicted to wait at least ``min_predicted_s``.

    A quantile, not the mean: with the mean, half the requests admitted at the edge of the queue waited
    longer than the target, and the admitted p99 is what the target promises. Each ratio above the factor
    raises it by ``step * quantile`` (relative), each ratio at or below lowers it by ``step * (1 -
    quantile)``, so it settles where a fraction ``1 - quantile`` of the ratios lie above it (or at its lower
    bound, 1 by default, when that quantile is below it); one stuck request moves it by one step only.
    (The admitted p99 also holds requests admitted on short queues, so a quantile below 0.99 is enough,
    and a higher one shortens the queue the batches are filled from.)"""

    def __init__(
        self,
        *,
        quantile: float = CALIBRATION_QUANTILE,
        step: float = CALIBRATION_STEP,
        min_predicted_s: float = CALIBRATION_MIN_PREDICTED_S,
        bounds: tuple[float, float] = CALIBRATION_BOUNDS,
    ) -> None:
        if not 0.0 < quantile < 1.0 or not 0.0 < step < 1.0:
            raise ValueError(f"quantile and step must lie in (0, 1), not {quantile} and {step}")
        self.quantile = quantile
        self.step = step
        self.min_predicted_s = min_predicted_s
        self.bounds = bounds
        self.factor = 1.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s < self.min_predicted_s or actual_s < 0:
            return
        if actual_s / predicted_s > self.factor:
            self.factor *= 1.0 + self.step * self.quantile
        else:
            self.factor *= 1.0 - self.step * (1.0 - self.quantile)
        self.factor = min(max(self.factor, self.bounds[0]), self.bounds[1])
