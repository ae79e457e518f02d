"""Admission by predicted wait: say no early and cheaply, before any image is decoded.

A request is admitted when its images can be served within the queue-delay target (never beyond the
request's own deadline), predicted from the work already ahead of it on its model and the measured cost
of one image at its token count. Otherwise it is refused at once with the time after which it would fit
(``Retry-After``). The queue bound in images stays as a hard cap across all models.

The rule (``decide``) is a pure function of numbers, so it is tested on injected estimates; the state
around it (``AdmissionControl``: images reserved per model, the batch in flight, recent forward passes)
lives in the same module and is driven by the engine (admit) and the batchers (begin, end, drop).

Fairness between callers: admission counts images, so a 64-image request costs 64 times a single one. A
request whose own work exceeds half the target is charged half the target: it is admitted only while the
queue ahead of it is at most half full, so large requests cannot take the whole queue from single-image
callers, and a request larger than the target can still be served. The hard cap has the same rule in
images: a request of n images is admitted only while it leaves room for n - 1 more images of other
callers (an idle queue admits any request the cap allows), so a run of 64-image requests holds at most
about three quarters of a 256-image queue and single images always find a place; a single image is not
affected.

Decoding ahead: on a model served on the CPU, every image admitted but not yet decoded (a place leased
on a request head whose body is still being read, or a reservation whose image waits for the decode pool)
will take its decode's CPU time from the cores the forward pass runs on, so the work ahead also counts
``ingest_share`` times that time per such image (``IngestEstimate``; the share is the fraction of decode
workers that find no core torch leaves free: ``served_model.ingest_share``). The throughput estimate,
measured in a steady flow, holds the decode of a steady flow (the few images of that flow still to be
decoded are charged again: measured, it cost no goodput); a flood's opening burst leases hundreds of
places before any body is read, and the first answer left ~0.45 s later
(bench/results/overload-history.md): the burst's requests overshot the target by that much.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vitembed.engine.wait_estimates import IngestEstimate, ThroughputEstimate, WaitCalibration

ADMITTED = "admitted"
QUEUE_FULL = "queue_full"  # the hard cap in images
QUEUE_DELAY = "queue_delay"  # the predicted wait passes the queue-delay target
DEADLINE = "deadline"  # the predicted wait passes the request's own (shorter) deadline
REASONS = (QUEUE_FULL, QUEUE_DELAY, DEADLINE)

# Retry-After spreading (``RetrySpread``): refused callers are told to come back at different whole seconds so
# that, together, they return at about this many times the model's throughput
SPREAD_RETURN_FACTOR = 2.0
SPREAD_MAX_S = 8  # the widest spread in seconds (a held connection waits at most 10 s)
# a request that passed the check before its body was read holds a place this long (``ModelLoad.admit``)
LEASE_S = 1.0
RELEASE_LOG = 1024  # releases of queued work a model remembers (``ModelLoad.settle``)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str  # ADMITTED or one of REASONS
    predicted_wait_s: float  # from now until the request's last image is done, if admitted now
    retry_after_s: float  # when refused: how long until it would fit (0 when admitted)
    limit_s: float  # the wait the request was allowed: min(target, its deadline)


def decide(
    *,
    images: int,
    per_image_s: float,
    ahead_s: float,
    held_images: int,
    capacity_images: int,
    target_s: float,
    deadline_left_s: float,
    batch_wait_s: float = 0.0,
    batch_tail_s: float = 0.0,
    idle: bool | None = None,
) -> Decision:
    """Admit ``images`` or refuse them, from injected numbers.

    ``per_image_s``: the measured forward cost of one of these images (0 when nothing is measured yet:
    only the hard cap applies); ``ahead_s``: predicted seconds of work queued or running before them on
    their model; ``held_images``: images queued or running on all models (the hard cap's count);
    ``batch_wait_s``: how long a batch may wait to fill; ``batch_tail_s``: the work of the images that may
    share the request's last batch, queued behind it: its rows come when that batch ends (under a flood the
    batch is full, and at 16 images the tail is ~0.15 s, which the admitted p99 overshot the target by);
    ``idle``: nothing is queued, running or about to be (default: ``ahead_s`` is 0).
    """
    own_s = images * per_image_s
    predicted = (
        batch_wait_s + ahead_s + own_s + batch_tail_s
    )  # the batch timer counts here, not in the target
    limit = min(target_s, deadline_left_s)
    room = images if held_images == 0 else 2 * images - 1  # its images, and room for n - 1 of others'
    if held_images + room > capacity_images:
        excess = held_images + room - capacity_images
        return Decision(False, QUEUE_FULL, predicted, excess * per_image_s, limit)
    if ahead_s <= 0.0 if idle is None else idle:  # an idle model takes whatever the hard cap allows; its
        # deadline decides the rest
        return Decision(True, ADMITTED, predicted, 0.0, limit)
    charged = ahead_s + min(own_s, target_s / 2) + batch_tail_s
    if charged > target_s:
        return Decision(False, QUEUE_DELAY, predicted, charged - target_s, limit)
    if predicted > deadline_left_s:  # the deadline, not the target, is what it is refused against
        return Decision(False, DEADLINE, predicted, predicted - deadline_left_s, deadline_left_s)
    return Decision(True, ADMITTED, predicted, 0.0, limit)


class RetrySpread:
    """Spread the ``Retry-After`` of refused requests over whole seconds, so they do not all return at once.

    Every refusal under one flood gets about the same short wait (the excess over the target is usually
    under a second, and the header counts whole seconds), so hundreds of callers came back in the same
    second, all but a few were refused again, and the server spent its cores answering them. Here each
    refusal books the images it will bring back into a second: the first second from its own wait on that
    still has room, where a second has room for ``return_factor`` times the model's throughput (enough to
    keep the queue full, no more), at most ``max_spread_s`` seconds later than its own wait. Callers refused
    earlier are let back earlier.

    The room comes from the throughput estimate, not from the admissions measured: fewer returns would mean
    fewer admissions, which would shrink the room further."""

    def __init__(
        self, *, return_factor: float = SPREAD_RETURN_FACTOR, max_spread_s: int = SPREAD_MAX_S
    ) -> None:
        self.return_factor = return_factor
        self.max_spread_s = max_spread_s
        self._booked: dict[int, int] = {}  # whole second (of the monotonic clock) -> images due back then

    def retry_after_s(self, base_s: float, images: int, per_image_s: float, now: float) -> float:
        """The wait to tell a refused request of ``images`` whose own wait would be ``base_s``: ``base_s``
        plus 0..max_spread_s-1 whole seconds (``Retry-After`` rounds the sum up)."""
        for second in [second for second in self._booked if second < now - 1]:
            del self._booked[second]
        if per_image_s <= 0:
            return base_s
        room = self.return_factor / per_image_s  # images per second to let back
        first = math.floor(now) + max(1, math.ceil(base_s))  # the second its own Retry-After lets it back
        seconds = [first + extra for extra in range(self.max_spread_s)]
        chosen = next(
            (s for s in seconds if self._booked.get(s, 0) == 0 or self._booked[s] + images <= room),
            min(seconds, key=lambda s: self._booked.get(s, 0)),
        )
        self._booked[chosen] = self._booked.get(chosen, 0) + images
        return base_s + (chosen - first)

    @property
    def pending_images(self) -> int:
        return sum(self._booked.values())


class QueueFullError(Exception):
    """Refused at admission; ``reason`` is one of ``REASONS``, ``retry_after_s`` when it would fit."""

    def __init__(
        self,
        retry_after_s: float,
        *,
        reason: str = QUEUE_FULL,
        predicted_wait_s: float = 0.0,
        limit_s: float = 0.0,
    ) -> None:
        super().__init__(f"refused ({reason}); retry in {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.predicted_wait_s = predicted_wait_s
        self.limit_s = limit_s


class Reservation:
    """The images of one admitted request that have not yet reached a forward pass."""

    def __init__(
        self,
        load: ModelLoad,
        tokens: int,
        images: int,
        predicted_wait_s: float,
        uncalibrated_wait_s: float | None = None,
    ) -> None:
        self.load = load
        self.tokens = tokens
        self.remaining = images
        self.predicted_wait_s = predicted_wait_s  # calibrated: what admission judged
        # the forward-pass estimate's own prediction (what the calibration compares the actual wait with)
        self.uncalibrated_wait_s = predicted_wait_s if uncalibrated_wait_s is None else uncalibrated_wait_s
        self.admitted_at = time.monotonic()
        self.lease: int | None = None  # a check's place held while the body is read (``ModelLoad.admit``)
        self.undecoded = images  # of ``remaining``, the images not yet decoded (``ModelLoad.decoded``)
        self.seq = load.next_seq()  # its place in the model's order of admission
        self.releases_before = load.releases  # releases of queued work before its admission

    def release(self, count: int | None = None) -> None:
        """``count`` images (all remaining by default) leave without a forward pass: dropped or failed."""
        self.load.release(self, self.remaining if count is None else count)

    def decoded(self) -> None:
        """One of its images is decoded (its decode no longer lies ahead of the queue)."""
        self.load.decoded(self)


class ModelLoad:
    """One model's share of the admission state: images reserved (admitted, being decoded or queued),
    the batch in flight, and the throughput estimate. All methods are thread-safe."""

    def __init__(
        self,
        control: AdmissionControl,
        name: str,
        batch_wait_s: float,
        batch_images: Callable[[int], int] | None = None,
        ingest_share: float = 0.0,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError("a model needs at least one forward thread")
        self._control = control
        self.name = name
        self.batch_wait_s = batch_wait_s
        self._batch_images = batch_images  # tokens per image -> images per forward pass (None: 1)
        # how much of an image's decode CPU time delays the forward pass: 1 where they share all the cores
        # (a CPU model with a thread per core), 0 where the forward pass runs elsewhere (a GPU)
        self.ingest_share = ingest_share
        # forward passes that run side by side (forward threads): the estimate holds seconds of the model's
        # time per image, a pass's duration over the passes sharing the cores, so that the queue ahead
        # drains at the estimate's rate whatever the number of threads
        self.workers = workers
        self.estimate = ThroughputEstimate()
        self.ingest = IngestEstimate()
        self.calibration = WaitCalibration()
        self.spread = RetrySpread()
        self._reserved: Counter[int] = Counter()  # expected tokens -> images
        self._undecoded = 0  # reserved images not yet decoded
        # passes running now: id -> (images, predicted duration of the pass, started at)
        self._running: dict[int, tuple[int, float, float]] = {}
        self._next_pass = 0
        self._leases: dict[int, tuple[float, int, int]] = {}  # id -> (expires at, images, tokens)
        self._next_lease = 0
        # releases of queued work (``release``: dropped or failed), ever, and the admission order (``seq``) of
        # the requests whose work was released, most recent last
        self.releases = 0
        self._released_seqs: deque[int] = deque(maxlen=RELEASE_LOG)
        self._seq = 0

    # ------------------------------------------------------------------ the request side
    def admit(
        self,
        images: int,
        tokens: int,
        deadline_left_s: float,
        *,
        reserve: bool = True,
        lease: bool = False,
        own_lease: int | None = None,
    ) -> Reservation:
        """Reserve ``images`` of ``tokens`` tokens each, or raise ``QueueFullError`` with the reason.

        ``reserve=False`` only checks (the early refusal before a body is read); with ``lease`` a request
        that passes holds a place for ``LEASE_S`` (its id in ``Reservation.lease``), so that requests whose
        heads arrive while its body is read see the queue it is about to join and are refused on their heads,
        before their own bodies are read, rather than after. The full check gives back ``own_lease``.
        """
        control = self._control
        with control.lock:
            now = control.clock()
            if own_lease is not None:
                self._leases.pop(own_lease, None)
            leased_images, leased_s = self._leased(now)
            per_image = self.estimate.per_image_s(tokens) or 0.0
            # a check on a head waits behind the places leased before it; a full check (its body is in) does
            # not: the leased requests still reading their bodies will queue behind it. Leased places still
            # make the model busy: a full check beside them is charged, not admitted as if the model were idle
            queued = self._ahead_s()
            ahead = queued + (leased_s if not reserve else 0.0)
            factor = self.calibration.factor
            decision = decide(
                images=images,
                per_image_s=per_image * factor,
                ahead_s=ahead * factor,
                held_images=control.held + leased_images,
                capacity_images=control.capacity,
                target_s=control.target_s,
                deadline_left_s=deadline_left_s,
                batch_wait_s=self.batch_wait_s,
                batch_tail_s=self._batch_tail_s(tokens, per_image) * factor,
                idle=queued <= 0.0 and leased_images == 0,
            )
            if not decision.admitted:
                retry_after = decision.retry_after_s
                if control.spread_retries:  # the room per second is the forward passes' own throughput:
                    # the calibration's tail quantile says how long the last in line may wait, not how fast
                    # the queue drains, and would let too few back to keep it full
                    retry_after = self.spread.retry_after_s(retry_after, images, per_image, now)
                raise QueueFullError(
                    retry_after,
                    reason=decision.reason,
                    predicted_wait_s=decision.predicted_wait_s,
                    limit_s=decision.limit_s,
                )
            own = images * per_image + self._batch_tail_s(tokens, per_image)
            uncalibrated = self.batch_wait_s + ahead + own
            if not reserve:
                checked = Reservation(self, tokens, 0, decision.predicted_wait_s, uncalibrated)
                if lease:
                    self._next_lease += 1
                    self._leases[self._next_lease] = (now + LEASE_S, images, tokens)
                    checked.lease = self._next_lease
                return checked
            self._reserved[tokens] += images
            self._undecoded += images
            control.held += images
            return Reservation(self, tokens, images, decision.predicted_wait_s, uncalibrated)

    def holds_lease(self, lease: int) -> bool:
        """Whether ``lease`` still holds its place (given out, neither traded nor lapsed)."""
        with self._control.lock:
            held = self._leases.get(lease)
            return held is not None and held[0] > self._control.clock()

    def drop_lease(self, lease: int) -> None:
        """Give ``lease``'s place back now (nothing if it was traded or has lapsed)."""
        with self._control.lock:
            self._leases.pop(lease, None)

    def _leased(self, now: float) -> tuple[int, float]:
        """Images held by unexpired leases, and their predicted seconds (caller holds the lock)."""
        for lease in [lease for lease, (expires, _, _) in self._leases.items() if expires <= now]:
            del self._leases[lease]
        images = sum(count for _, count, _ in self._leases.values())
        seconds = sum(
            count * (self.estimate.per_image_s(tokens) or 0.0) for _, count, tokens in self._leases.values()
        )
        return images, seconds + images * self._ingest_s()

    def _ingest_s(self) -> float:
        """Seconds one image's decode, still ahead, adds to the wait (caller holds the lock)."""
        return self.ingest_share * self.ingest.per_image_s

    def _batch_tail_s(self, tokens: int, per_image: float) -> float:
        """The rest of the request's last batch: up to images-per-pass - 1 images queued behind it; with
        passes side by side, a pass lasts that many times longer than its share of the model's time."""
        if self._batch_images is None:
            return 0.0
        return (self._batch_images(tokens) * self.workers - 1) * per_image

    def _ahead_s(self) -> float:
        """Predicted seconds until work admitted now could start (caller holds the lock)."""
        ahead = self._undecoded * self._ingest_s()
        for tokens, count in self._reserved.items():
            ahead += count * (self.estimate.per_image_s(tokens) or 0.0)
        if self._running:
            now = time.monotonic()
            left = sum(max(run_s - (now - since), 0.0) for _, run_s, since in self._running.values())
            ahead += left / self.workers
        return ahead

    def predicted_wait_s(self, images: int, tokens: int) -> float:
        with self._control.lock:
            per_image = self.estimate.per_image_s(tokens) or 0.0
            own = images * per_image + self._batch_tail_s(tokens, per_image)
            return self.batch_wait_s + self.calibration.factor * (self._ahead_s() + own)

    def settle(self, reservation: Reservation, actual_wait_s: float) -> None:
        """An admitted request got its last row ``actual_wait_s`` after admission: calibrate predictions,
        unless work admitted before it left the queue unserved while it waited (dropped: a client gone, a
        deadline passed; or failed). Its wait then says nothing about the estimate: when a flood's clients
        all left at once, the requests still queued behind their dropped work waited a fraction of their
        prediction, and ~130 such ratios pulled the factor down. Work released behind it did not shorten
        its wait and does not count."""
        with self._control.lock:
            since = self.releases - reservation.releases_before
            if since > len(self._released_seqs):
                return  # more releases than remembered: it cannot tell, so it does not learn
            recent = list(self._released_seqs)[len(self._released_seqs) - since :]
            if any(seq < reservation.seq for seq in recent):
                return
            self.calibration.observe(reservation.uncalibrated_wait_s, actual_wait_s)

    def next_seq(self) -> int:
        """The next admission's place in order (the caller holds the lock: ``admit``)."""
        self._seq += 1
        return self._seq

    def release(self, reservation: Reservation, count: int) -> None:
        with self._control.lock:
            count = min(count, reservation.remaining)
            if count <= 0:
                return
            # a dropped queued image was decoded; a failed or cancelled request releases all it has left
            undecoded = max(0, count - (reservation.remaining - reservation.undecoded))
            reservation.undecoded -= undecoded
            self._undecoded -= undecoded
            reservation.remaining -= count
            self._take(reservation.tokens, count)
            self._control.held -= count
            self.releases += 1
            self._released_seqs.append(reservation.seq)

    def decoded(self, reservation: Reservation) -> None:
        with self._control.lock:
            if reservation.undecoded > 0:  # nothing when its request was already released (cancelled)
                reservation.undecoded -= 1
                self._undecoded -= 1

    def observe_ingest(self, cpu_s: float) -> None:
        """One image decoded and preprocessed in ``cpu_s`` seconds of its thread's CPU time."""
        with self._control.lock:
            self.ingest.observe(cpu_s)

    # ------------------------------------------------------------------ the forward thread's side
    def begin(self, reservations: Iterable[Reservation], tokens: int) -> int:
        """A batch starts: its images move from reserved to running. Returns the pass's id for ``end``."""
        with self._control.lock:
            count = 0
            for reservation in reservations:
                if reservation.remaining > 0:
                    reservation.remaining -= 1
                    self._take(reservation.tokens, 1)
                    count += 1
                    if reservation.undecoded > reservation.remaining:  # reached a pass without ``decoded``
                        self._undecoded -= reservation.undecoded - reservation.remaining
                        reservation.undecoded = reservation.remaining
            self._next_pass += 1
            run_s = count * (self.estimate.per_image_s(tokens) or 0.0) * self.workers
            self._running[self._next_pass] = (count, run_s, time.monotonic())
            return self._next_pass

    def observe(self, tokens: int, images: int, seconds: float) -> None:
        """A forward pass timed outside the queue (the start-up measurement, alone: as if the other
        forward threads ran beside it)."""
        with self._control.lock:
            self.estimate.observe(tokens, images, seconds / self.workers)

    def end(self, running: int, tokens: int, images: int, seconds: float | None) -> None:
        """Pass ``running`` (``begin``'s id) is done: its images leave the hard cap; a pass that succeeded
        (``seconds`` given) joins the throughput estimate."""
        with self._control.lock:
            if seconds is not None:
                self.estimate.observe(tokens, images, seconds / self.workers)
            count, _, _ = self._running.pop(running, (0, 0.0, 0.0))
            self._control.held -= count

    def _take(self, tokens: int, count: int) -> None:
        left = self._reserved[tokens] - count
        if left > 0:
            self._reserved[tokens] = left
        else:
            del self._reserved[tokens]

    @property
    def reserved_images(self) -> int:
        with self._control.lock:
            return sum(self._reserved.values())


class AdmissionControl:
    """The hard cap in images across all models, the queue-delay target, and one ``ModelLoad`` each."""

    def __init__(
        self,
        capacity: int,
        target_s: float,
        *,
        spread_retries: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or target_s <= 0:
            raise ValueError("the admission capacity must be ≥ 1 image and the target > 0 s")
        self.capacity = capacity
        self.target_s = target_s
        self.spread_retries = spread_retries  # RetrySpread on each model's refusals
        self.clock = clock  # the spread's seconds and the leases' expiry (injected by tests)
        self.lock = threading.Lock()
        self.held = 0  # images reserved or running, all models
        self._loads: dict[str, ModelLoad] = {}

    def model(
        self,
        name: str,
        *,
        batch_wait_s: float = 0.0,
        batch_images: Callable[[int], int] | None = None,
        ingest_share: float = 0.0,
        workers: int = 1,
    ) -> ModelLoad:
        with self.lock:
            load = self._loads.get(name)
            if load is None:
                load = self._loads[name] = ModelLoad(
                    self, name, batch_wait_s, batch_images, ingest_share, workers
                )
            return load

    @property
    def used(self) -> int:
        return self.held
