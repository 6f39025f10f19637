"""The scaler's pure core: trigger metadata and the replica rule, with time passed in."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scaler.decision import METRIC_TARGET, SIGNALS, Inputs, Stabiliser, decide, recommend
from services.scaler.trigger import KEDA_KEYS, KEYS, SHOWN_CHARS, Trigger, TriggerError, parse_trigger

NOW = 1_000_000.0


def fresh(
    depth: int = 0,
    util: float | None = None,
    current: int | None = None,
    draining: int = 0,
    kv: float | None = None,
    ttft: float | None = None,
    load_pods: int | None = None,
) -> Inputs:
    reported = kv is not None or ttft is not None or load_pods is not None
    return Inputs(
        queue_depth=depth,
        queue_read_at=NOW - 0.5,
        gpu_util=util,
        util_sampled_at=NOW - 1 if util is not None else None,
        current_replicas=current,
        draining_pods=draining,
        kv_util=kv,
        ttft_p90_s=ttft,
        load_read_at=NOW - 2 if reported else None,
        load_pods=(load_pods if load_pods is not None else (current or 1)) if reported else 0,
    )


def test_queue_only_is_depth_over_per_replica_rounded_up() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=4)
    assert recommend(t, fresh(0), NOW).desired == 0
    assert not recommend(t, fresh(0), NOW).active
    assert recommend(t, fresh(1), NOW).desired == 1
    assert recommend(t, fresh(8), NOW).desired == 2
    assert recommend(t, fresh(9), NOW).desired == 3


def test_utilisation_only_follows_the_hpa_formula() -> None:
    t = Trigger(namespace="llm", deployment="d", gpu_util_target=50)
    d = recommend(t, fresh(0, util=90, current=2), NOW)
    assert d.util_replicas == 4 and d.desired == 4 and not d.active  # the queue is empty: KEDA may go to zero
    t = Trigger(namespace="llm", deployment="d", gpu_util_target=70, activation_gpu_util=10)
    d = recommend(t, fresh(0, util=70, current=3), NOW)
    assert d.desired == 3 and d.active  # exactly on target: no float rounding up to 4


def test_combined_max_and_sum() -> None:
    base = {"namespace": "llm", "deployment": "d", "queue_depth_per_replica": 4, "gpu_util_target": 50.0}
    inputs = fresh(10, util=90, current=2)
    assert recommend(Trigger(**base, combine="max"), inputs, NOW).desired == 4  # type: ignore[arg-type]
    assert recommend(Trigger(**base, combine="sum"), inputs, NOW).desired == 7  # type: ignore[arg-type]


def test_drain_surge_adds_the_pods_of_draining_nodes_within_limits() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=4, max_replicas=6)
    d = recommend(t, fresh(8, draining=3), NOW)
    assert d.surge == 3 and d.desired == 5 and "drain surge 3" in d.reason
    assert recommend(t, fresh(16, draining=3), NOW).desired == 6
    off = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=4, drain_surge=False)
    assert recommend(off, fresh(8, draining=3), NOW).desired == 2


def test_a_preparing_rollout_keeps_the_current_replicas() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=4, gpu_util_target=60, max_replicas=5)
    idle = Inputs(**{**_fields(fresh(0, util=5, current=4)), "rollout": "r-7"})
    d = recommend(t, idle, NOW)
    assert d.desired == 4 and d.active and "rollout r-7 preparing" in d.reason
    assert recommend(t, fresh(0, util=5, current=4), NOW).desired == 1  # without it: scaled down
    busy = Inputs(**{**_fields(fresh(40, util=5, current=4)), "rollout": "r-7"})
    assert recommend(t, busy, NOW).desired == 5  # never a ceiling: scaling up goes on
    many = Inputs(**{**_fields(fresh(0, current=9)), "rollout": "r-7"})
    assert recommend(t, many, NOW).desired == 5  # within maxReplicas


def _fields(inputs: Inputs) -> dict[str, object]:
    return {name: getattr(inputs, name) for name in Inputs.__slots__}


def test_stale_inputs_never_scale_down_and_nothing_fresh_holds_or_is_unavailable() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=1, gpu_util_target=50)
    before = recommend(t, fresh(5, util=50, current=5), NOW)
    assert before.desired == 5
    old_util = Inputs(queue_depth=1, queue_read_at=NOW, gpu_util=90, util_sampled_at=NOW - 600, current_replicas=5)
    d = recommend(t, old_util, NOW, before)
    assert d.util_replicas is None and "gpu" in d.stale and d.desired == 5 and d.held
    old_queue = Inputs(queue_depth=50, queue_read_at=NOW - 60)
    d = recommend(t, old_queue, NOW, before)
    assert d.available and d.held and d.desired == 5 and set(d.stale) == {"queue", "replicas"}
    d = recommend(t, old_queue, NOW, None)
    assert not d.available and "no fresh input" in d.reason


def test_metric_value_makes_the_hpa_average_value_formula_exact() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=3, max_replicas=1000)
    for depth in range(0, 3000, 7):
        d = recommend(t, fresh(depth), NOW)
        assert math.ceil(d.metric_value / METRIC_TARGET) == d.desired


def test_stabiliser_scales_up_at_once_and_down_after_the_window() -> None:
    s = Stabiliser(window_s=60)
    assert s.apply(0, 2) == 2
    assert s.apply(1, 5) == 5
    assert s.apply(30, 3) == 5
    assert s.apply(61, 3) == 5  # t=30 carried 3, t=1 carried 5 and aged out only after 61
    assert s.apply(62, 3) == 3
    assert s.apply(63, 1) == 3


@pytest.mark.parametrize(
    ("meta", "key", "words"),
    [
        ({}, "deployment", "missing"),
        ({"deployment": "Bad_Name"}, "deployment", "Kubernetes name"),
        ({"deployment": "d", "queueDepthPerReplica": "0"}, "queueDepthPerReplica", ">= 1"),
        ({"deployment": "d", "queueDepthPerReplica": "x"}, "queueDepthPerReplica", "not an integer"),
        ({"deployment": "d", "gpuUtilTarget": "150"}, "gpuUtilTarget", "up to 100"),
        ({"deployment": "d", "combine": "avg"}, "combine", "'max' or 'sum'"),
        ({"deployment": "d", "minReplicas": "5", "maxReplicas": "2"}, "minReplicas", "above maxReplicas"),
        ({"deployment": "d", "stabilisationWindow": "soon"}, "stabilisationWindow", "'5m'"),
        ({"deployment": "d", "drainSurge": "yes"}, "drainSurge", "'true' or 'false'"),
        ({"deployment": "d", "queueDepthPerReplca": "3"}, "queueDepthPerReplca", "did you mean 'queueDepthPerReplica'"),
    ],
)
def test_bad_metadata_names_the_key_and_what_is_allowed(meta: dict[str, str], key: str, words: str) -> None:
    with pytest.raises(TriggerError) as info:
        parse_trigger(meta, "llm")
    assert info.value.key == key and words in str(info.value)


KNOWN_KEYS = sorted(KEYS | KEDA_KEYS)
filler = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=1500)
metadata = st.dictionaries(
    st.one_of(st.sampled_from(KNOWN_KEYS), st.text(min_size=1, max_size=400)),
    st.one_of(filler, st.integers(-(10**40), 10**40).map(str)),
    max_size=80,
)


@given(metadata)
@settings(max_examples=300, deadline=None)
def test_any_metadata_is_a_trigger_or_a_short_error_that_quotes_no_more_than_a_prefix(meta: dict[str, str]) -> None:
    try:
        parse_trigger(meta, "llm")
    except TriggerError as exc:
        message = str(exc)
        assert len(message) <= 400, message
        sent = [*meta, *meta.values()]
        longest = max((len(text) for text in sent if text and text in message), default=0)
        assert longest <= max(SHOWN_CHARS, max(map(len, KNOWN_KEYS))), message


def test_metadata_defaults_and_keda_keys() -> None:
    t = parse_trigger(
        {"deployment": "d", "scalerAddress": "x:9090", "enableTLS": "true", "stabilisationWindow": "5m"}, "llm"
    )
    assert t == Trigger(namespace="llm", deployment="d", stabilisation_window_s=300.0)
    assert t.metric_name == "gpuwarden-llm-d"


triggers = st.builds(
    Trigger,
    namespace=st.just("llm"),
    deployment=st.just("d"),
    queue_depth_per_replica=st.integers(1, 50),
    gpu_util_target=st.one_of(st.none(), st.floats(1, 100)),
    combine=st.sampled_from(["max", "sum"]),
    activation_queue_depth=st.integers(0, 20),
    min_replicas=st.integers(0, 5),
    max_replicas=st.integers(5, 200),
    stabilisation_window_s=st.floats(0, 600),
    kv_cache_util_target=st.one_of(st.none(), st.floats(1, 100)),
    ttft_p90_target_ms=st.one_of(st.none(), st.floats(1, 10_000)),
)
utils = st.one_of(st.none(), st.floats(0, 100))
currents = st.one_of(st.none(), st.integers(0, 50))
kvs = st.one_of(st.none(), st.floats(0, 1))
ttfts = st.one_of(st.none(), st.floats(0, 30))


@settings(max_examples=300, deadline=None)
@given(triggers, st.integers(0, 10_000), st.integers(0, 10_000), utils, currents, st.integers(0, 8))
def test_monotone_in_queue_depth(
    t: Trigger, a: int, b: int, util: float | None, current: int | None, draining: int
) -> None:
    low, high = sorted((a, b))
    d_low = recommend(t, fresh(low, util, current, draining), NOW)
    d_high = recommend(t, fresh(high, util, current, draining), NOW)
    assert d_low.desired <= d_high.desired


@settings(max_examples=300, deadline=None)
@given(
    triggers,
    st.lists(st.tuples(st.integers(0, 10_000), utils, currents, st.integers(0, 8), st.booleans()), max_size=20),
)
def test_within_limits_whatever_the_inputs(
    t: Trigger, steps: list[tuple[int, float | None, int | None, int, bool]]
) -> None:
    stabiliser, previous, now = Stabiliser(t.stabilisation_window_s), None, NOW
    for depth, util, current, draining, stale_queue in steps:
        now += 1
        inputs = fresh(depth, util, current, draining)
        if stale_queue:
            inputs = Inputs(queue_depth=depth, queue_read_at=now - 3600, current_replicas=current)
        d = decide(t, inputs, now, stabiliser, previous)
        if d.available:
            assert t.min_replicas <= d.desired <= t.max_replicas
            assert d.metric_value == d.desired * METRIC_TARGET
            previous = d


@settings(max_examples=200, deadline=None)
@given(triggers, st.integers(0, 10_000), utils, currents, st.integers(0, 8), st.integers(2, 50))
def test_no_flapping_under_a_stable_input(
    t: Trigger, depth: int, util: float | None, current: int | None, draining: int, ticks: int
) -> None:
    stabiliser, previous = Stabiliser(t.stabilisation_window_s), None
    seen = set()
    for i in range(ticks):
        now = NOW + i * 7.0
        inputs = Inputs(
            queue_depth=depth,
            queue_read_at=now,
            gpu_util=util,
            util_sampled_at=now if util is not None else None,
            current_replicas=current,
            draining_pods=draining,
        )
        previous = decide(t, inputs, now, stabiliser, previous)
        seen.add((previous.desired, previous.active))
    assert len(seen) == 1


@settings(max_examples=200, deadline=None)
@given(triggers, st.integers(1, 10_000), st.floats(0, 1))
def test_a_dip_inside_the_window_does_not_scale_down(t: Trigger, depth: int, fraction: float) -> None:
    stabiliser = Stabiliser(t.stabilisation_window_s)
    high = decide(t, fresh(depth), NOW, stabiliser)
    dip = decide(t, fresh(0), NOW + t.stabilisation_window_s * fraction, stabiliser, high)
    assert dip.desired == high.desired


# -- KV-cache utilisation and time to first token -------------------------------------------------------------------
def test_kv_cache_and_ttft_follow_the_hpa_formula_and_name_the_signal() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=4, kv_cache_util_target=70)
    d = recommend(t, fresh(4, current=2, kv=0.85), NOW)
    assert (d.queue_replicas, d.kv_replicas, d.desired, d.signal) == (1, 3, 3, "kv")  # ceil(2 x 85 / 70)
    assert "kv 2x85%/70% -> 3" in d.reason and "= 3 by kv" in d.reason
    t = Trigger(namespace="llm", deployment="d", ttft_p90_target_ms=500)
    d = recommend(t, fresh(0, current=2, ttft=0.9), NOW)
    assert (d.ttft_replicas, d.desired, d.signal) == (4, 4, "ttft")  # ceil(2 x 900 / 500)
    assert "ttft p90 2x900ms/500ms -> 4" in d.reason


def test_the_most_demanding_signal_wins_and_ties_go_in_order() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=1, gpu_util_target=50, kv_cache_util_target=50)
    assert recommend(t, fresh(6, util=50, current=2, kv=0.5), NOW).signal == "queue"  # 6 > 2, 2
    assert recommend(t, fresh(1, util=100, current=2, kv=0.5), NOW).signal == "gpu"  # 4 > 1, 2
    d = recommend(t, fresh(2, util=50, current=2, kv=1.0), NOW)
    assert (d.desired, d.signal, d.signal_replicas) == (4, "kv", {"queue": 2, "gpu": 2, "kv": 4})
    assert recommend(t, fresh(2, util=50, current=2, kv=0.5), NOW).signal == "queue"  # a tie: the first
    summed = Trigger(**{**_trigger_fields(t), "combine": "sum"})
    d = recommend(summed, fresh(2, util=50, current=2, kv=0.5), NOW)
    assert (d.desired, d.signal) == (4, "queue+gpu")


def _trigger_fields(t: Trigger) -> dict[str, object]:
    return {name: getattr(t, name) for name in Trigger.__slots__}


def test_a_missing_load_report_is_stale_never_zero_and_never_scales_down() -> None:
    t = Trigger(namespace="llm", deployment="d", queue_depth_per_replica=10, kv_cache_util_target=50)
    before = recommend(t, fresh(1, current=4, kv=0.9), NOW)
    assert (before.desired, before.signal) == (8, "kv")
    silent = fresh(1, current=4)  # no pod reported
    d = recommend(t, silent, NOW, before)
    assert d.kv_replicas is None and "load" in d.stale and d.desired == 8 and d.held and d.signal == "held"
    old = Inputs(**{**_fields(fresh(1, current=4, kv=0.1)), "load_read_at": NOW - t.load_stale_after_s - 1})
    d = recommend(t, old, NOW, before)
    assert d.kv_replicas is None and "load" in d.stale and d.desired == 8
    unknown_pool = fresh(1, current=4, load_pods=4)  # reports without blocks_total: utilisation unknown
    assert "kv" in recommend(t, unknown_pool, NOW, before).stale
    d = recommend(t, fresh(1, current=0), NOW, before)  # no pod at all: nothing to report, nothing stale
    assert d.kv_replicas == 0 and not d.stale and d.desired == 1 and d.signal == "queue"


def test_no_first_token_in_the_window_is_idle_not_stale() -> None:
    t = Trigger(namespace="llm", deployment="d", ttft_p90_target_ms=200, kv_cache_util_target=80)
    d = recommend(t, fresh(0, current=3, kv=0.2, ttft=None), NOW)
    assert d.ttft_replicas is None and not d.stale and d.desired == 1 and d.signal == "kv"


def test_drain_surge_adds_on_top_of_kv_pressure() -> None:
    t = Trigger(namespace="llm", deployment="d", kv_cache_util_target=50, max_replicas=10)
    d = recommend(t, fresh(0, current=2, kv=1.0, draining=2), NOW)
    assert (d.kv_replicas, d.surge, d.desired, d.signal) == (4, 2, 6, "kv") and "drain surge 2" in d.reason
    d = recommend(t, fresh(0, current=2, kv=0.0, draining=2), NOW)
    assert (d.desired, d.signal) == (3, "drain-surge")  # active (pods drain): at least one, plus the surge
    assert recommend(t, fresh(0, current=4, kv=1.0, draining=4), NOW).signal == "maxReplicas"


def test_new_keys_are_read_and_checked() -> None:
    t = parse_trigger({"deployment": "d", "kvCacheUtilTarget": "75", "ttftP90TargetMs": "250ms"}, "llm")
    assert (t.kv_cache_util_target, t.ttft_p90_target_ms, t.load_stale_after_s) == (75.0, 250.0, 15.0)
    assert parse_trigger({"deployment": "d", "loadStaleAfter": "30s"}, "llm").load_stale_after_s == 30.0
    for meta, key, words in (
        ({"kvCacheUtilTarget": "0"}, "kvCacheUtilTarget", "out of range"),
        ({"kvCacheUtilTarget": "full"}, "kvCacheUtilTarget", "not a number"),
        ({"ttftP90TargetMs": "-5"}, "ttftP90TargetMs", "out of range"),
        ({"ttftP90TargetMs": "nan"}, "ttftP90TargetMs", "out of range"),
        ({"ttftP90TargetMs": "fast"}, "ttftP90TargetMs", "milliseconds"),
        ({"loadStaleAfter": "0.01"}, "loadStaleAfter", "too short"),
        ({"kvCacheTarget": "70"}, "kvCacheTarget", "did you mean 'kvCacheUtilTarget'"),
    ):
        with pytest.raises(TriggerError) as info:
            parse_trigger({"deployment": "d", **meta}, "llm")
        assert info.value.key == key and words in str(info.value), str(info.value)


@settings(max_examples=300, deadline=None)
@given(triggers, st.integers(0, 10_000), utils, currents, kvs, ttfts, st.integers(0, 8))
def test_the_count_is_the_most_demanding_signal_within_the_limits(
    t: Trigger, depth: int, util: float | None, current: int | None, kv: float | None, ttft: float | None, drain: int
) -> None:
    d = recommend(t, fresh(depth, util, current, drain, kv, ttft), NOW)
    assert d.available and d.signal in SIGNALS
    asked = d.signal_replicas
    if t.combine == "sum" and "queue" in asked and "gpu" in asked:
        asked = {"queue+gpu": asked.pop("queue") + asked.pop("gpu"), **asked}
    base = max(asked.values())
    expected = (max(base, 1) if d.active else base) + d.surge
    assert d.desired == min(max(expected, t.min_replicas), t.max_replicas)
    if d.signal in asked:  # a signal that set the count asked for the most
        assert asked[d.signal] == base
        assert all(n < base for name, n in asked.items() if list(asked).index(name) < list(asked).index(d.signal))


@settings(max_examples=300, deadline=None)
@given(triggers, kvs, kvs, ttfts, ttfts, st.integers(1, 50))
def test_monotone_in_kv_cache_utilisation_and_ttft(
    t: Trigger, kv_a: float | None, kv_b: float | None, ttft_a: float | None, ttft_b: float | None, current: int
) -> None:
    kv_low, kv_high = sorted((kv_a or 0.0, kv_b or 0.0))
    ttft_low, ttft_high = sorted((ttft_a or 0.0, ttft_b or 0.0))
    low = recommend(t, fresh(0, None, current, 0, kv_low, ttft_low), NOW)
    high = recommend(t, fresh(0, None, current, 0, kv_high, ttft_high), NOW)
    assert low.desired <= high.desired


@settings(max_examples=200, deadline=None)
@given(triggers, st.integers(0, 10_000), currents, kvs, ttfts)
def test_load_going_missing_never_lowers_the_count(
    t: Trigger, depth: int, current: int | None, kv: float | None, ttft: float | None
) -> None:
    reported = fresh(depth, None, current, 0, kv, ttft)
    before = recommend(t, reported, NOW)
    after = recommend(t, Inputs(**{**_fields(reported), "load_read_at": None}), NOW + 1, before)
    if "load" in after.stale:
        assert after.desired >= before.desired
    else:  # the load was not read (no target), or there is no pod to report it
        assert (t.kv_cache_util_target is None and t.ttft_p90_target_ms is None) or current == 0
