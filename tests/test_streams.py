"""StreamOrder and wait_for_producer with CUDA's event calls replaced by a recorder: which stream
waits for what, when plan() and run() share a stream, use two, or run under graph capture."""

from __future__ import annotations

import itertools
import types

import pytest

from splitkv import streams

PLAN, OTHER, THIRD = 0x5000, 0x7000, 0x9000


@pytest.fixture
def calls(monkeypatch):
    log = types.SimpleNamespace(events=itertools.count(1), records=[], waits=[], capturing=set())
    monkeypatch.setattr(streams, "_new_event", lambda: types.SimpleNamespace(ptr=next(log.events)))
    monkeypatch.setattr(streams, "_record", lambda event, ptr: log.records.append((event.ptr, ptr)))
    monkeypatch.setattr(streams, "_wait", lambda ptr, event: log.waits.append((ptr, event.ptr)))
    monkeypatch.setattr(streams, "is_capturing", lambda ptr: ptr in log.capturing)
    return log


def test_one_stream_waits_for_nothing(calls):
    order = streams.StreamOrder()
    for _ in range(3):
        order.before_plan(PLAN)
        order.planned(PLAN)
        for _ in range(2):
            order.before_run(PLAN)
            order.after_run(PLAN)
    assert calls.waits == []
    assert calls.records == [(1, PLAN)] * 3  # one event per plan, reused


def test_run_on_another_stream_waits_once_per_plan_and_the_next_plan_waits_for_it(calls):
    order = streams.StreamOrder()
    order.planned(PLAN)
    order.before_run(OTHER)
    order.after_run(OTHER)
    order.before_run(OTHER)  # already ordered after this plan
    order.after_run(OTHER)
    plan_event, run_event = 1, 2
    assert calls.waits == [(OTHER, plan_event)]
    assert calls.records == [(plan_event, PLAN), (run_event, OTHER), (run_event, OTHER)]

    order.before_plan(PLAN)  # the workspace is rewritten only after the run on OTHER
    assert calls.waits[-1] == (PLAN, run_event)
    order.planned(PLAN)
    order.before_run(OTHER)  # a new plan: OTHER waits again
    assert calls.waits[-1] == (OTHER, plan_event)
    order.before_plan(PLAN)  # no run since: nothing more to wait for
    assert len(calls.waits) == 3


def test_the_next_plan_waits_for_every_other_stream_that_ran(calls):
    order = streams.StreamOrder()
    order.planned(PLAN)
    for stream in (OTHER, THIRD, PLAN):
        order.before_run(stream)
        order.after_run(stream)
    calls.waits.clear()
    order.before_plan(PLAN)
    assert sorted(ptr for ptr, _ in calls.waits) == [PLAN, PLAN]
    assert len({event for _, event in calls.waits}) == 2


def test_a_plan_on_a_new_stream_waits_for_runs_on_the_old_one(calls):
    order = streams.StreamOrder()
    order.planned(PLAN)
    order.before_run(PLAN)
    order.after_run(PLAN)  # the plan's own stream: nothing recorded after the run...
    assert calls.records == [(1, PLAN)]
    order.before_plan(OTHER)  # ...so a plan moving to another stream waits for all of PLAN's work
    moved = 2
    assert calls.records[-1] == (moved, PLAN) and calls.waits == [(OTHER, moved)]
    order.planned(OTHER)
    order.before_run(PLAN)  # and runs on the old stream wait for the new plan's writes
    assert calls.waits[-1] == (PLAN, 1)


def test_a_plan_does_not_wait_on_a_stream_under_capture(calls):
    order = streams.StreamOrder()
    order.planned(PLAN)
    calls.capturing.add(PLAN)
    order.before_plan(OTHER)
    assert calls.waits == []


def test_captured_runs_wait_in_every_capture_and_are_not_recorded(calls):
    order = streams.StreamOrder()
    order.planned(PLAN)
    calls.capturing.add(OTHER)
    for _ in range(2):
        order.before_run(OTHER)
        order.after_run(OTHER)
    assert calls.waits == [(OTHER, 1), (OTHER, 1)]  # each becomes a node of the graph being captured
    assert calls.records == [(1, PLAN)]


def test_the_legacy_default_stream_has_two_handles(calls):
    order = streams.StreamOrder()
    order.planned(0)
    order.before_run(1)
    order.after_run(1)
    assert calls.waits == [] and calls.records == [(1, 0)]
    assert streams.same_stream(0, 1) and not streams.same_stream(1, 2)


def test_wait_for_producer(calls):
    held = {}
    streams.wait_for_producer(None, OTHER, held)
    streams.wait_for_producer(OTHER, OTHER, held)
    streams.wait_for_producer(1, 0, held)
    assert calls.waits == [] and calls.records == []
    streams.wait_for_producer(PLAN, OTHER, held)
    streams.wait_for_producer(PLAN, THIRD, held)
    assert calls.records == [(1, PLAN), (1, PLAN)]  # one event per producer stream, reused
    assert calls.waits == [(OTHER, 1), (THIRD, 1)]


@pytest.mark.parametrize("capturing, flags", [(False, 0), (True, 1)])
def test_a_wait_under_capture_becomes_an_external_event_node(monkeypatch, capturing, flags):
    import cupy

    runtime = cupy.cuda.runtime
    seen = []
    monkeypatch.setattr(runtime, "streamIsCapturing",
                        lambda ptr: runtime.streamCaptureStatusActive if capturing else runtime.streamCaptureStatusNone)
    monkeypatch.setattr(runtime, "streamWaitEvent", lambda ptr, event, flags: seen.append((ptr, event, flags)))
    streams._wait(OTHER, types.SimpleNamespace(ptr=0xE0))
    assert seen == [(OTHER, 0xE0, flags)]
