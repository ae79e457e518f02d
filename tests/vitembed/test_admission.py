"""Admission by predicted wait, on injected throughput estimates: which request is admitted, which is
refused and why, and which ``Retry-After`` it gets (deterministic: no clocks, no forward passes)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from vitembed.engine.admission import (
    ADMITTED,
    DEADLINE,
    LEASE_S,
    QUEUE_DELAY,
    QUEUE_FULL,
    AdmissionControl,
    Decision,
    ModelLoad,
    QueueFullError,
    RetrySpread,
    decide,
)
from vitembed.engine.wait_estimates import ESTIMATE_KEYS, IngestEstimate, ThroughputEstimate, WaitCalibration


def rule(**overrides: float) -> Decision:
    numbers: dict[str, float] = {
        "images": 1,
        "per_image_s": 0.125,
        "ahead_s": 0.0,
        "held_images": 0,
        "capacity_images": 256,
        "target_s": 2.0,
        "deadline_left_s": 30.0,
        **overrides,
    }
    return decide(
        images=int(numbers["images"]),
        per_image_s=numbers["per_image_s"],
        ahead_s=numbers["ahead_s"],
        held_images=int(numbers["held_images"]),
        capacity_images=int(numbers["capacity_images"]),
        target_s=numbers["target_s"],
        deadline_left_s=numbers["deadline_left_s"],
        batch_wait_s=numbers.get("batch_wait_s", 0.0),
        batch_tail_s=numbers.get("batch_tail_s", 0.0),
    )


def retry_after_header(decision: Decision) -> int:
    """What the HTTP layer sends: whole seconds, at least 1."""
    return max(1, math.ceil(decision.retry_after_s))


def test_single_images_fill_the_queue_up_to_the_target_and_no_further() -> None:
    assert rule(ahead_s=1.875) == Decision(True, ADMITTED, 2.0, 0.0, 2.0)  # ends exactly at the target
    refused = rule(ahead_s=2.0)
    assert refused == Decision(False, QUEUE_DELAY, 2.125, 0.125, 2.0)
    assert retry_after_header(refused) == 1
    far = rule(ahead_s=5.25)  # 3.375 s of work must drain first
    assert (far.reason, far.retry_after_s, retry_after_header(far)) == (QUEUE_DELAY, 3.375, 4)


def test_an_idle_model_admits_any_request_the_hard_cap_allows() -> None:
    big = rule(images=64, per_image_s=0.25)  # 16 s of its own work, far over the 2 s target
    assert big == Decision(True, ADMITTED, 16.0, 0.0, 2.0)
    assert rule(images=64, held_images=200, capacity_images=256).reason == QUEUE_FULL


def test_a_deadline_refusal_is_measured_against_the_deadline_not_the_target() -> None:
    # 24 images x 0.125 s = 3 s of work behind 0.5 s: charged 0.5 + 1 s (half the 2 s target), within it, but
    # predicted 3.5 s on a 3 s deadline; the limit it names is the deadline's 3 s, not the target's 2 s
    refused = rule(images=24, ahead_s=0.5, deadline_left_s=3.0)
    assert refused == Decision(False, DEADLINE, 3.5, 0.5, 3.0)


def test_large_requests_are_charged_half_the_target_so_they_cannot_take_the_whole_queue() -> None:
    # 64 images x 0.125 s = 8 s of work: admitted only while at most half the target (1 s) is queued ahead
    assert rule(images=64, ahead_s=1.0) == Decision(True, ADMITTED, 9.0, 0.0, 2.0)
    refused = rule(images=64, ahead_s=1.25)
    assert refused == Decision(False, QUEUE_DELAY, 9.25, 0.25, 2.0)
    # single images still get in up to the full target, behind it
    assert rule(ahead_s=1.875).admitted and not rule(images=64, ahead_s=1.875).admitted


def test_the_hard_cap_in_images_refuses_with_the_time_to_drain_the_excess() -> None:
    refused = rule(images=2, held_images=255, capacity_images=256, ahead_s=0.5)
    assert refused == Decision(False, QUEUE_FULL, 0.75, 0.25, 2.0)  # 2 images too many x 0.125 s
    assert retry_after_header(refused) == 1
    assert rule(images=1, held_images=255, capacity_images=256, ahead_s=0.5).admitted  # the last place


def test_a_request_of_n_images_leaves_room_for_n_minus_1_of_other_callers() -> None:
    # 8 images with 250 held: 8 + 7 places needed, 6 free; 9 images too many x 0.125 s
    refused = rule(images=8, held_images=250, capacity_images=256, ahead_s=0.5)
    assert refused == Decision(False, QUEUE_FULL, 1.5, 1.125, 2.0)
    assert retry_after_header(refused) == 2
    assert rule(images=3, held_images=250, capacity_images=256, ahead_s=0.5).admitted  # 250 + 3 + 2
    assert not rule(images=4, held_images=250, capacity_images=256, ahead_s=0.5).admitted  # 250 + 4 + 3
    assert rule(images=64, held_images=129, capacity_images=256, per_image_s=0.0).admitted
    assert rule(images=64, held_images=130, capacity_images=256, per_image_s=0.0).reason == QUEUE_FULL
    # an idle queue admits any request the cap allows
    assert rule(images=256, held_images=0, capacity_images=256, per_image_s=0.0).admitted


def test_64_image_callers_cannot_starve_single_images() -> None:
    """Only the hard cap binds (a long target, a fast model): callers of 64 images fill what they may,
    then single images still find 64 places, and no 64-image request gets in meanwhile."""
    control = AdmissionControl(capacity=256, target_s=1000.0)
    load = control.model("m")
    load.observe(tokens=100, images=64, seconds=0.064)  # 1 ms per image
    big = []
    while True:
        try:
            big.append(load.admit(64, 100, deadline_left_s=30.0))
        except QueueFullError as refused:
            assert refused.reason == QUEUE_FULL
            break
    assert len(big) == 3 and control.held == 192  # 0 -> 64 (idle), 64 + 127 <= 256, 128 + 127 <= 256
    singles = []
    for _ in range(64):
        singles.append(load.admit(1, 100, deadline_left_s=30.0))
        with pytest.raises(QueueFullError):
            load.admit(64, 100, deadline_left_s=30.0)
    assert control.held == 256
    with pytest.raises(QueueFullError):
        load.admit(1, 100, deadline_left_s=30.0)
    big[0].release()  # 64 places free again: singles first in line get them, a 64-image request not
    assert control.held == 192
    with pytest.raises(QueueFullError):
        load.admit(64, 100, deadline_left_s=30.0)
    assert load.admit(1, 100, deadline_left_s=30.0).remaining == 1


def test_a_request_whose_own_deadline_is_shorter_than_the_wait_is_refused() -> None:
    assert rule(ahead_s=1.0, deadline_left_s=1.125).admitted
    refused = rule(ahead_s=1.0, deadline_left_s=0.5)  # within the 2 s target, past the client's 0.5 s
    assert refused == Decision(False, DEADLINE, 1.125, 0.625, 0.5)
    assert retry_after_header(refused) == 1
    # the batch timer counts towards the deadline, not towards the target
    assert rule(ahead_s=1.0, batch_wait_s=0.875, deadline_left_s=30.0).admitted
    timed = rule(ahead_s=1.0, batch_wait_s=0.875, deadline_left_s=1.5)
    assert (timed.reason, timed.predicted_wait_s, timed.retry_after_s) == (DEADLINE, 2.0, 0.5)


def test_without_a_measurement_only_the_hard_cap_applies() -> None:
    assert rule(per_image_s=0.0, ahead_s=0.0, images=64, held_images=129).admitted
    assert rule(per_image_s=0.0, images=64, held_images=130).reason == QUEUE_FULL


def test_the_model_load_admits_in_order_and_refuses_with_retry_after() -> None:
    """Eight single images of 0.125 s fill a 1 s target; the ninth is told to come back in 0.125 s; a
    dropped image frees its place; a request of another size is priced by the nearest measurement."""
    control = AdmissionControl(capacity=16, target_s=1.0)
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)  # 0.125 s per image of 100 tokens
    admitted = [load.admit(1, 100, deadline_left_s=30.0) for _ in range(8)]
    assert [r.predicted_wait_s for r in admitted] == [0.125 * (i + 1) for i in range(8)]
    with pytest.raises(QueueFullError) as refused:
        load.admit(1, 100, deadline_left_s=30.0)
    assert (refused.value.reason, refused.value.retry_after_s, refused.value.predicted_wait_s) == (
        QUEUE_DELAY,
        0.125,
        1.125,
    )
    assert control.held == 8
    admitted[3].release(1)  # dropped before its forward pass
    assert control.held == 7 and load.admit(1, 100, deadline_left_s=30.0).predicted_wait_s == 1.0
    with pytest.raises(QueueFullError) as doubled:  # 200 tokens: 0.25 s per image, scaled from 100
        load.admit(1, 200, deadline_left_s=30.0)
    assert (doubled.value.reason, doubled.value.retry_after_s) == (QUEUE_DELAY, 0.25)


def test_the_hard_cap_is_shared_by_all_models() -> None:
    control = AdmissionControl(capacity=4, target_s=100.0)
    first, second = control.model("a"), control.model("b")
    first.admit(3, 10, deadline_left_s=30.0)
    with pytest.raises(QueueFullError) as refused:
        second.admit(2, 10, deadline_left_s=30.0)
    assert refused.value.reason == QUEUE_FULL
    second.admit(1, 10, deadline_left_s=30.0)
    assert control.held == 4


def test_the_throughput_estimate_follows_recent_passes() -> None:
    estimate = ThroughputEstimate(window=4)
    assert estimate.per_image_s(100) is None
    estimate.observe(100, 1, 0.5)  # a lone image after a quiet spell
    estimate.observe(100, 8, 1.5)
    assert estimate.per_image_s(100) == 2.0 / 9  # full batches weigh by their images
    for _ in range(4):  # the window forgets the oldest passes
        estimate.observe(100, 8, 1.0)
    assert estimate.per_image_s(100) == 0.125
    assert estimate.per_image_s(300) == 0.375  # never measured: scaled from the nearest token count
    estimate.observe(300, 2, 1.0)
    assert estimate.per_image_s(300) == 0.5 and estimate.per_image_s(250) == 0.5 * 250 / 300


def test_the_wait_calibration_tracks_a_high_quantile_of_actual_over_predicted_within_bounds() -> None:
    calibration = WaitCalibration(quantile=0.95, step=0.05, min_predicted_s=0.5, bounds=(0.75, 4.0))
    calibration.observe(predicted_s=0.2, actual_s=5.0)  # too short a prediction to say anything
    assert calibration.factor == 1.0
    calibration.observe(predicted_s=1.0, actual_s=100.0)  # one stuck request moves it by one step only
    assert calibration.factor == pytest.approx(1.0475)
    calibration.observe(predicted_s=1.0, actual_s=0.5)  # one quick request: a twentieth of a step down
    assert calibration.factor == pytest.approx(1.0475 * 0.9975)
    # ratios spread evenly over 1.0 .. 2.0: the factor settles near their 95th percentile, not their mean
    ratios = [1.0 + i / 99 for i in range(100)]
    for round_ in range(60):
        for i in range(100):
            calibration.observe(predicted_s=1.0, actual_s=ratios[(i * 37 + round_) % 100])
    assert 1.8 <= calibration.factor <= 2.05  # (the mean, 1.5, is far below; steps of ~5 % make it wobble)
    for _ in range(2000):
        calibration.observe(predicted_s=2.0, actual_s=0.1)  # faster than predicted: down to the lower bound
    assert calibration.factor == 0.75
    for _ in range(200):
        calibration.observe(predicted_s=1.0, actual_s=50.0)  # and up to the upper one
    assert calibration.factor == 4.0
    with pytest.raises(ValueError, match="quantile and step"):
        WaitCalibration(quantile=1.0)


def test_a_calibrated_model_load_admits_only_what_it_can_serve_within_the_target() -> None:
    """Measured waits twice the forward-pass estimate halve the queue admitted for a 1 s target: four
    single images of 0.125 s (calibrated 0.25 s) instead of eight; Retry-After and the predicted wait
    are calibrated too, and the calibration compares the actual wait with the uncalibrated prediction."""
    control = AdmissionControl(capacity=16, target_s=1.0)
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)  # 0.125 s per image of 100 tokens
    load.calibration = WaitCalibration(step=0.999, quantile=0.5)
    first = load.admit(1, 100, deadline_left_s=30.0)
    first.uncalibrated_wait_s = 0.5  # as if admitted behind three others
    load.settle(first, actual_wait_s=1.0)  # waited longer than predicted: the factor rises
    assert load.calibration.factor == pytest.approx(1.4995)
    load.calibration.factor = 2.0
    first.release()
    admitted = [load.admit(1, 100, deadline_left_s=30.0) for _ in range(4)]
    assert [r.predicted_wait_s for r in admitted] == [0.25 * (i + 1) for i in range(4)]
    assert [r.uncalibrated_wait_s for r in admitted] == [0.125 * (i + 1) for i in range(4)]
    with pytest.raises(QueueFullError) as refused:
        load.admit(1, 100, deadline_left_s=30.0)
    assert (refused.value.reason, refused.value.retry_after_s, refused.value.predicted_wait_s) == (
        QUEUE_DELAY,
        0.25,
        1.25,
    )
    assert load.predicted_wait_s(1, 100) == 1.25


def test_refusals_are_spread_so_that_they_return_at_twice_the_throughput() -> None:
    """0.125 s per image: 8 images/s, so refused callers are let back at 16 images/s. The first 16 refusals
    fit in the second their own wait ends in; 64 refusals at once fill 4 whole seconds, 16 each, in order."""
    spread = RetrySpread()
    waits = [spread.retry_after_s(0.25, 1, 0.125, now=100.5) for _ in range(64)]
    assert waits == [0.25] * 16 + [1.25] * 16 + [2.25] * 16 + [3.25] * 16
    assert spread.pending_images == 64
    # later refusals queue behind them; once they are all due back, a refusal keeps its own wait again
    assert spread.retry_after_s(0.25, 1, 0.125, now=100.9) == 4.25
    assert spread.retry_after_s(0.25, 1, 0.125, now=110.0) == 0.25
    assert spread.pending_images == 1


def test_the_spread_lets_callers_back_at_the_forward_passes_throughput_whatever_the_calibration() -> None:
    """The calibration says how long the last in line may wait, not how fast the queue drains: with a
    factor of 2 the spread still lets 16 single images back per second at 0.125 s per image (not 8)."""
    control = AdmissionControl(capacity=256, target_s=1.0, clock=lambda: 100.5)
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)
    load.calibration.factor = 2.0
    for _ in range(4):  # 4 x 0.25 s calibrated: the queue is at its 1 s target
        load.admit(1, 100, deadline_left_s=30.0)
    waits = []
    for _ in range(32):
        with pytest.raises(QueueFullError) as refused:
            load.admit(1, 100, deadline_left_s=30.0)
        waits.append(refused.value.retry_after_s)
    base = waits[0]
    assert waits == [base] * 16 + [base + 1] * 16


def test_the_spread_counts_images_and_is_capped() -> None:
    spread = RetrySpread(max_spread_s=3)
    # 1 s per image: 2 images/s let back; a 64-image refusal takes a second of its own, then the least booked
    waits = [spread.retry_after_s(1.5, 64, 1.0, now=0.0) for _ in range(5)]
    assert waits == [1.5, 2.5, 3.5, 1.5, 2.5]
    # a single image still finds room in no second: the least booked one
    assert spread.retry_after_s(1.5, 1, 1.0, now=0.0) == 3.5
    # without a throughput measurement nothing is spread
    assert RetrySpread().retry_after_s(0.5, 64, 0.0, now=0.0) == 0.5


def test_a_flood_of_refusals_gets_spread_retry_after_headers() -> None:
    """Through the model load: 40 refused single images at 0.125 s per image (16 let back per second) get
    Retry-After 1, 2 and 3 s, 16, 16 and 8 of them; without spreading every one of them is told 1 s."""
    for spread_retries, expected in ((True, {1: 16, 2: 16, 3: 8}), (False, {1: 40})):
        control = AdmissionControl(
            capacity=256, target_s=1.0, spread_retries=spread_retries, clock=lambda: 1000.5
        )
        load = control.model("m")
        load.observe(tokens=100, images=8, seconds=1.0)
        for _ in range(8):
            load.admit(1, 100, deadline_left_s=30.0)
        headers: Counter[int] = Counter()
        for _ in range(40):
            with pytest.raises(QueueFullError) as refused:
                load.admit(1, 100, deadline_left_s=30.0)
            headers[max(1, math.ceil(refused.value.retry_after_s))] += 1
        assert headers == expected
        assert control.held == 8


def test_a_passed_check_holds_a_place_while_its_body_is_read() -> None:
    """0.125 s per image, 1 s target: eight places. Eight heads pass the check with leases, so the ninth head
    is refused on its head; each full check gives its own lease back (not double-counted); a lease whose
    request never came back (a bad body) lapses after LEASE_S."""
    clock = [100.0]
    control = AdmissionControl(capacity=256, target_s=1.0, spread_retries=False, clock=lambda: clock[0])
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)
    leases = [load.admit(1, 100, 30.0, reserve=False, lease=True).lease for _ in range(8)]
    assert len(set(leases)) == 8 and control.held == 0
    with pytest.raises(QueueFullError) as refused:
        load.admit(1, 100, 30.0, reserve=False, lease=True)
    assert refused.value.reason == QUEUE_DELAY
    with pytest.raises(QueueFullError):  # the request-head gate (a check without lease) sees them too
        load.admit(1, 100, 30.0, reserve=False)
    # seven bodies arrive: each full check trades its lease for a reservation
    for lease in leases[:7]:
        load.admit(1, 100, 30.0, own_lease=lease)
    assert control.held == 7
    with pytest.raises(QueueFullError):  # the eighth lease still holds the last place
        load.admit(1, 100, 30.0, reserve=False, lease=True)
    clock[0] += LEASE_S  # its body never came: the place is free again
    assert load.admit(1, 100, 30.0, reserve=False).lease is None  # a check without lease holds nothing
    assert load.admit(1, 100, 30.0, reserve=False, lease=True).lease is not None
    with pytest.raises(QueueFullError):
        load.admit(1, 100, 30.0, reserve=False)


def test_the_default_calibration_never_predicts_shorter_than_the_forward_passes() -> None:
    """A calm spell (requests finishing faster than the lagging estimate) must not lower the predictions: a
    flood arriving next would be admitted on them, past what it can serve within the target."""
    calibration = WaitCalibration()
    for _ in range(500):
        calibration.observe(predicted_s=2.0, actual_s=1.0)
    assert calibration.factor == 1.0
    calibration.observe(predicted_s=1.0, actual_s=3.0)
    assert calibration.factor > 1.0


def test_waits_shortened_by_work_dropped_ahead_of_them_do_not_calibrate() -> None:
    """0.125 s per image. Eight requests queue; the first four are dropped (their clients left), so the
    others wait half their prediction: those waits say nothing about the estimate and leave the factor
    alone. A request admitted after the drop calibrates as usual."""
    control = AdmissionControl(capacity=256, target_s=2.0, spread_retries=False)
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)
    queued = [load.admit(1, 100, deadline_left_s=30.0) for _ in range(8)]
    assert [r.uncalibrated_wait_s for r in queued][-1] == 1.0
    factor = load.calibration.factor
    for gone in queued[:4]:
        gone.release()  # dropped before its forward pass
    for waited in queued[4:]:
        load.settle(waited, actual_wait_s=3.0 * waited.uncalibrated_wait_s)  # would raise the factor
    assert load.calibration.factor == factor
    later = load.admit(1, 100, deadline_left_s=30.0)  # four images still ahead of it: 0.625 s with its own
    assert later.uncalibrated_wait_s == 0.625
    behind = load.admit(1, 100, deadline_left_s=30.0)
    behind.release()  # dropped behind it: that did not shorten its wait
    load.settle(later, actual_wait_s=1.25)
    assert load.calibration.factor > factor


def test_a_full_check_does_not_count_places_leased_to_heads_still_sending_their_bodies() -> None:
    """Eight heads hold leases for a 1 s target at 0.125 s per image, so a ninth head is refused. A request
    whose body is in (a full check) queues ahead of those still arriving: it is admitted on the queue
    itself, and the hard cap still counts the leased places."""
    clock = [100.0]
    control = AdmissionControl(capacity=9, target_s=1.0, spread_retries=False, clock=lambda: clock[0])
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)
    for _ in range(8):
        load.admit(1, 100, 30.0, reserve=False, lease=True)
    with pytest.raises(QueueFullError):
        load.admit(1, 100, 30.0, reserve=False, lease=True)
    admitted = load.admit(1, 100, 30.0)  # a body in, no lease of its own (its model was named in the body)
    assert admitted.uncalibrated_wait_s == 0.125 and control.held == 1
    with pytest.raises(QueueFullError) as refused:  # 1 reserved + 8 leased: the hard cap of 9 is reached
        load.admit(1, 100, 30.0)
    assert refused.value.reason == QUEUE_FULL


def test_places_leased_on_heads_keep_the_model_from_looking_idle() -> None:
    """An idle model admits any request the hard cap allows, even 8 s of work on a 5 s deadline; a model
    whose only work is places leased on heads is not idle: the same body is judged like any other."""
    clock = [100.0]
    control = AdmissionControl(capacity=256, target_s=1.0, spread_retries=False, clock=lambda: clock[0])
    load = control.model("m")
    load.observe(tokens=100, images=8, seconds=1.0)  # 0.125 s per image: 64 images are 8 s of work
    idle = load.admit(64, 100, 5.0)
    assert idle.predicted_wait_s == 8.0
    idle.release()
    for _ in range(4):
        load.admit(1, 100, 30.0, reserve=False, lease=True)
    with pytest.raises(QueueFullError) as refused:
        load.admit(64, 100, 5.0)
    assert (refused.value.reason, refused.value.retry_after_s) == (DEADLINE, 3.0)


def test_the_estimate_forgets_the_least_recently_measured_token_counts() -> None:
    estimate = ThroughputEstimate(window=2)
    for tokens in range(1, ESTIMATE_KEYS + 2):  # one token count more than it remembers
        estimate.observe(tokens * 100, 1, 1.0)  # 1 s per image whatever the tokens: not proportional
    assert estimate.per_image_s(200) == 1.0
    assert estimate.per_image_s(100) == pytest.approx(0.5)  # forgotten: scaled from 200 (1 s x 100 / 200)
    estimate.observe(100, 1, 3.0)  # measured again: remembered, and 200, now the oldest, is forgotten
    assert estimate.per_image_s(100) == 3.0
    estimate.observe(ESTIMATE_KEYS * 200, 1, 1.0)  # a new token count: 300 is forgotten
    assert estimate.per_image_s(300) == pytest.approx(1.0 * 300 / 400)  # forgotten: scaled from 400


def test_a_request_waits_for_the_rest_of_its_batch_too() -> None:
    """Its rows come when its batch ends: with sixteen images per pass at 0.0625 s each, up to fifteen
    queued behind it share that pass (0.9375 s). A 2 s target then admits a single image behind 1 s of
    work, not 1.9375 s; a large request is still charged at most half the target for its own images."""
    tail = 15 * 0.0625
    assert rule(per_image_s=0.0625, ahead_s=1.0, batch_tail_s=tail) == Decision(True, ADMITTED, 2.0, 0.0, 2.0)
    refused = rule(per_image_s=0.0625, ahead_s=1.0625, batch_tail_s=tail)
    assert (refused.reason, refused.predicted_wait_s, refused.retry_after_s) == (QUEUE_DELAY, 2.0625, 0.0625)
    big = rule(images=64, per_image_s=0.0625, ahead_s=0.0625, batch_tail_s=tail)  # 4 s of its own work
    assert big.admitted and big.predicted_wait_s == 0.0625 + 4.0 + tail
    control = AdmissionControl(capacity=256, target_s=2.0, spread_retries=False)
    load = control.model("m", batch_images=lambda tokens: 1600 // tokens)  # 16 images of 100 tokens
    load.observe(tokens=100, images=16, seconds=1.0)
    first = load.admit(1, 100, deadline_left_s=30.0)
    assert first.predicted_wait_s == 16 * 0.0625  # its own image and the fifteen that may share its pass
    admitted = [load.admit(1, 100, deadline_left_s=30.0) for _ in range(16)]
    assert admitted[-1].predicted_wait_s == 32 * 0.0625  # 16 ahead, its own, 15 behind: the 2 s target
    with pytest.raises(QueueFullError):  # 17 ahead: 2.0625 s
        load.admit(1, 100, deadline_left_s=30.0)
    # 400 tokens (the estimate scales to 0.25 s per image): four per pass, so three may share its pass
    assert load.predicted_wait_s(1, 400) == pytest.approx(17 * 0.0625 + 4 * 0.25)


def test_decoding_still_ahead_is_counted_where_it_shares_the_cores_with_the_forward_pass() -> None:
    """0.125 s of forward pass and 0.125 s of decode CPU per image, a 1 s target. Where the decode takes its
    time from the forward pass (ingest_share 1), a place leased on a head, whose body is still to be read and
    decoded, costs 0.25 s: four heads pass and the fifth is refused 0.125 s over the target; where it does not
    (ingest_share 0, an accelerator) eight pass, as before."""
    for share, passed in ((1.0, 4), (0.0, 8)):
        control = AdmissionControl(capacity=256, target_s=1.0, spread_retries=False, clock=lambda: 100.0)
        load = control.model("m", ingest_share=share)
        load.observe(tokens=100, images=8, seconds=1.0)
        load.observe_ingest(0.125)
        for _ in range(passed):
            load.admit(1, 100, 30.0, reserve=False, lease=True)
        with pytest.raises(QueueFullError) as refused:
            load.admit(1, 100, 30.0, reserve=False, lease=True)
        assert (refused.value.reason, refused.value.retry_after_s) == (QUEUE_DELAY, 0.125)


def test_a_reservation_counts_its_decode_until_each_image_is_decoded() -> None:
    """Admitted images wait for the decode pool before they queue: each costs its decode too until
    ``decoded``. A dropped queued image was decoded (its release leaves the decode count alone); a failed or
    cancelled request releases its undecoded images with the rest, and a decode that ends after that (its
    pool job outlived the request) changes nothing."""
    control = AdmissionControl(capacity=256, target_s=2.0, spread_retries=False)
    load = control.model("m", ingest_share=1.0)
    load.observe(tokens=100, images=8, seconds=1.0)  # 0.125 s per image
    load.observe_ingest(0.0625)
    first = load.admit(2, 100, deadline_left_s=30.0)
    assert first.predicted_wait_s == 0.25  # an idle model: its own two images
    assert load.predicted_wait_s(1, 100) == 2 * (0.125 + 0.0625) + 0.125
    first.decoded()
    assert load.predicted_wait_s(1, 100) == 2 * 0.125 + 0.0625 + 0.125
    first.decoded()
    first.decoded()  # one more than it has: nothing
    assert load.predicted_wait_s(1, 100) == 2 * 0.125 + 0.125
    first.release(1)  # a queued (decoded) image dropped
    assert load.predicted_wait_s(1, 100) == 0.125 + 0.125
    second = load.admit(3, 100, deadline_left_s=30.0)
    second.decoded()
    assert load.predicted_wait_s(1, 100) == 4 * 0.125 + 2 * 0.0625 + 0.125
    second.release()  # its request failed: all three go, two of them undecoded
    second.decoded()  # a pool job that outlived the request
    assert load.predicted_wait_s(1, 100) == 0.125 + 0.125
    third = load.admit(1, 100, deadline_left_s=30.0)
    running = load.begin(
        [first, third], tokens=100
    )  # third reached a pass without ``decoded``: not counted twice
    load.end(running, tokens=100, images=2, seconds=None)
    assert load.predicted_wait_s(1, 100) == 0.125 and control.held == 0


def test_the_ingest_estimate_averages_the_recent_decodes() -> None:
    estimate = IngestEstimate(window=4)
    assert estimate.per_image_s == 0.0
    for seconds in (1.0, 1.0, 1.0, 1.0, 0.5, 0.5):
        estimate.observe(seconds)
    assert estimate.per_image_s == 0.75  # the last four
    estimate.observe(-1.0)  # a clock that went backwards: ignored
    assert estimate.per_image_s == 0.75


def test_passes_side_by_side_count_the_model_time_they_leave() -> None:
    """Two forward threads: a pass of 8 images measured at 1 s is 1/16 s of the model's time per image. Two
    passes just begun (1 s left each, sharing the cores) delay the queue by 1 s, not 2; one left alone by
    half its time. The rest of a request's batch is a whole pass (8 x 2 - 1 images' worth) of its own."""
    control = AdmissionControl(capacity=64, target_s=10.0)
    load = control.model("m", batch_images=lambda tokens: 8, workers=2)
    load.observe(100, 8, 1.0)
    assert load.estimate.per_image_s(100) == pytest.approx(1 / 16)
    first = load.admit(8, 100, deadline_left_s=30.0)
    second = load.admit(8, 100, deadline_left_s=30.0)
    assert control.held == 16
    tail = 15 / 16
    assert load.predicted_wait_s(1, 100) == pytest.approx(16 / 16 + 1 / 16 + tail)
    a = load.begin([first] * 8, tokens=100)
    b = load.begin([second] * 8, tokens=100)
    # two passes just begun: 1 s each left, over two threads
    assert load.predicted_wait_s(1, 100) == pytest.approx(1.0 + 1 / 16 + tail, abs=0.01)
    load.end(a, 100, 8, 1.0)
    assert control.held == 8  # only the pass that ended leaves the hard cap
    assert load.predicted_wait_s(1, 100) == pytest.approx(0.5 + 1 / 16 + tail, abs=0.01)
    load.end(b, 100, 8, 1.0)
    assert control.held == 0 and load.predicted_wait_s(1, 100) == pytest.approx(1 / 16 + tail)
    with pytest.raises(ValueError, match="at least one forward thread"):
        ModelLoad(control, "x", 0.0, workers=0)
