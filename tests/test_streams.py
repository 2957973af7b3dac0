"""StreamOrder and wait_for_producer with CUDA's event calls replaced by a recorder: which stream
waits for what, when plan() and run() share a stream, use several, or run under graph capture."""

from __future__ import annotations

import itertools
import threading
import types

import pytest

from splitkv import streams

PLAN, OTHER, THIRD = 0x5000, 0x7000, 0x9000


@pytest.fixture
def calls(monkeypatch):
    # capturing: stream -> the id of the capture it is in (None: an id the runtime did not give)
    log = types.SimpleNamespace(events=itertools.count(1), records=[], waits=[], capturing={})
    monkeypatch.setattr(streams, "_new_event", lambda: types.SimpleNamespace(ptr=next(log.events)))
    monkeypatch.setattr(streams, "_record", lambda event, ptr: log.records.append((event.ptr, ptr)))

    def wait(ptr, event, *, in_capture=False):
        log.waits.append((ptr, event.ptr, in_capture))
    monkeypatch.setattr(streams, "_wait", wait)
    monkeypatch.setattr(streams, "is_capturing", lambda ptr: ptr in log.capturing)
    monkeypatch.setattr(streams, "capture_id", lambda ptr: log.capturing[ptr])
    return log


def _use(order, ptr):
    order.leave(ptr, order.enter(ptr))


def test_one_stream_waits_for_nothing(calls):
    order = streams.StreamOrder()
    for ptr in (PLAN, PLAN, PLAN, PLAN):  # plan, run, run, plan
        _use(order, ptr)
    assert calls.waits == []
    assert calls.records == [(1, PLAN)] * 4  # one event, re-recorded after each call


def test_every_call_on_another_stream_waits_for_the_one_before(calls):
    # plan on PLAN, runs on OTHER and THIRD (which write the same partials), plan again on PLAN:
    # each waits for the previous call's work, so all four run in call order.
    order = streams.StreamOrder()
    for ptr in (PLAN, OTHER, OTHER, THIRD, PLAN):
        _use(order, ptr)
    assert calls.waits == [(OTHER, 1, False), (THIRD, 1, False), (PLAN, 1, False)]
    assert [ptr for _, ptr in calls.records] == [PLAN, OTHER, OTHER, THIRD, PLAN]


def test_the_first_call_waits_for_nothing(calls):
    order = streams.StreamOrder()
    _use(order, OTHER)
    assert calls.waits == []


def test_a_capture_waits_once_per_graph_and_stream_and_records_nothing(calls):
    order = streams.StreamOrder()
    _use(order, PLAN)
    _use(order, OTHER)  # a warm-up run outside the capture (it waits for the plan)
    calls.capturing[OTHER] = 41
    for _ in range(3):  # a graph of three runs (layers): one wait node, the runs follow it
        _use(order, OTHER)
    assert calls.waits == [(OTHER, 1, False)] * 2
    calls.capturing[THIRD] = 41  # the same capture forked onto another stream: a node there too
    _use(order, THIRD)
    _use(order, THIRD)
    assert calls.waits[2:] == [(THIRD, 1, False)]
    calls.capturing = {OTHER: 42}  # the next capture on the last call's stream gets its own node
    _use(order, OTHER)
    _use(order, OTHER)
    assert calls.waits[3:] == [(OTHER, 1, False)]
    assert [ptr for _, ptr in calls.records] == [PLAN, OTHER]  # nothing recorded inside the captures
    calls.capturing = {}
    _use(order, PLAN)  # the next plan follows the last work outside the captures
    assert calls.waits[-1] == (PLAN, 1, False)


def test_without_a_capture_id_every_captured_call_waits(calls):
    order = streams.StreamOrder()
    _use(order, PLAN)
    calls.capturing[OTHER] = None
    for _ in range(3):
        _use(order, OTHER)
    assert calls.waits == [(OTHER, 1, False)] * 3


def test_nothing_outside_a_capture_before_it_leaves_its_graph_without_waits(calls):
    order = streams.StreamOrder()
    calls.capturing[OTHER] = 7
    _use(order, OTHER)
    _use(order, OTHER)
    assert calls.waits == [] and calls.records == []


def test_the_legacy_default_stream_has_two_handles(calls):
    order = streams.StreamOrder()
    _use(order, 0)
    _use(order, 1)
    assert calls.waits == []
    assert streams.stream_key(0) == streams.stream_key(1) != streams.stream_key(2)


def test_the_per_thread_default_stream_differs_between_threads(calls):
    order = streams.StreamOrder()
    _use(order, 2)
    _use(order, 2)
    assert calls.waits == []
    worker = threading.Thread(target=_use, args=(order, 2))
    worker.start()
    worker.join()
    assert calls.waits == [(2, 1, False)]  # another thread's default stream: it waits


def test_wait_for_producer(calls):
    held = {}
    streams.wait_for_producer(None, OTHER, held)
    streams.wait_for_producer(OTHER, OTHER, held)
    streams.wait_for_producer(1, 0, held)
    assert calls.waits == [] and calls.records == []
    streams.wait_for_producer(PLAN, OTHER, held)
    streams.wait_for_producer(PLAN, THIRD, held)
    assert calls.records == [(1, PLAN), (1, PLAN)]  # one event per producer stream, reused
    assert calls.waits == [(OTHER, 1, False), (THIRD, 1, False)]


def test_wait_for_producer_in_the_same_capture_is_a_graph_edge(calls):
    calls.capturing.update({PLAN: 5, OTHER: 5})
    streams.wait_for_producer(PLAN, OTHER, {})
    assert calls.waits == [(OTHER, 1, True)]


def test_wait_for_producer_refuses_the_legacy_stream_under_capture(calls):
    calls.capturing[OTHER] = 5
    with pytest.raises(RuntimeError, match="legacy default stream"):
        streams.wait_for_producer(1, OTHER, {})
    assert calls.records == []


@pytest.mark.parametrize("waiter_capturing, in_capture, flags", [(False, False, 0), (True, False, 1), (True, True, 0)])
def test_a_wait_under_capture_becomes_an_event_wait_node(monkeypatch, waiter_capturing, in_capture, flags):
    import cupy

    runtime = cupy.cuda.runtime
    seen = []
    monkeypatch.setattr(runtime, "streamIsCapturing", lambda ptr: waiter_capturing)
    monkeypatch.setattr(runtime, "streamWaitEvent", lambda ptr, event, flags: seen.append((ptr, event, flags)))
    streams._wait(OTHER, types.SimpleNamespace(ptr=0xE0), in_capture=in_capture)
    assert seen == [(OTHER, 0xE0, flags)]
