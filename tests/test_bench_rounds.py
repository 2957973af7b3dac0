"""CPU tests of the protocols' logic: the ABBA order, the checks that stand before any figure,
the rounds and their summary. The tensors are NumPy-backed stand-ins for torch's."""

import numpy as np
import pytest

from splitkv.bench import protocols
from splitkv.bench.cases import Case
from splitkv.bench.inputs import check, poison
from splitkv.bench.protocols import Settings, positions_balanced, prepare, round_order, run_rounds, summary


class T:
    """The few torch.Tensor methods that `check` and `poison` use."""

    def __init__(self, a):
        self.a = np.array(a, dtype=float)

    shape = property(lambda self: self.a.shape)

    def double(self):
        return T(self.a)

    def reshape(self, shape):
        return T(self.a.reshape(shape))

    def isfinite(self):
        return T(np.isfinite(self.a))

    def all(self):
        return bool(self.a.all())

    def abs(self):
        return T(np.abs(self.a))

    def max(self):
        return T(self.a.max())

    def item(self):
        return float(self.a)

    def cpu(self):
        return self

    def numpy(self):
        return self.a

    def __sub__(self, other):
        return T(self.a - other.a)

    def fill_(self, value):
        self.a[...] = value


class FakeLayers:
    def __init__(self, count=3):
        self.count = count
        self.refs = [T(np.full((1, 4, 2), float(i + 1))) for i in range(count)]

        class S:
            quantized = False
        self.shape = S()

    def reference(self):
        return self.refs


class FakeHarness:
    torch = None

    def synchronize(self):
        pass


def writer(layers, wrong_layer=None, skip_layer=None):
    """A case whose calls write each layer's reference (off by 50% in ``wrong_layer``, not at all in
    ``skip_layer``)."""
    outs = [T(np.zeros((1, 4, 2))) for _ in range(layers.count)]

    def launcher(i):
        def call():
            if i != skip_layer:
                outs[i].a[...] = layers.refs[i].a * (1.5 if i == wrong_layer else 1.0)
        return call
    return Case([launcher(i) for i in range(layers.count)], lambda: outs)


NO_GRAPH = Settings(protocols=("flush", "eager"))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_round_order_alternates_and_balances_positions(count):
    orders = [round_order(count, r) for r in range(2 * count)]
    for order in orders:
        assert sorted(order) == list(range(count))  # each round times every implementation once
    for r in range(0, 2 * count, 2):
        assert orders[r + 1] == orders[r][::-1]  # A B ..., then ... B A
    for v in range(count):
        assert sorted(o.index(v) for o in orders) == sorted(list(range(count)) * 2)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_multiples_of_twice_the_implementations_balance_positions(count):
    for rounds in range(2 * count, 8 * count + 1, 2 * count):
        assert positions_balanced(rounds, count)


def test_unbalanced_round_counts_are_found():
    # 4 implementations (splitkv, the baseline, its A/A copy, the floor) in 5 rounds: splitkv takes
    # positions 0, 3, 3, 0, 2 and the baseline 1, 2, 0, 3, 3.
    assert not positions_balanced(5, 4) and positions_balanced(8, 4)
    assert positions_balanced(2, 2) and not positions_balanced(3, 2)  # A B, B A already balances two
    assert not positions_balanced(2, 3) and positions_balanced(6, 3)
    assert positions_balanced(5, 1)


def test_two_implementations_run_abba():
    assert [round_order(2, r) for r in range(4)] == [[0, 1], [1, 0], [1, 0], [0, 1]]
    assert round_order(0, 3) == []


def test_check_finds_a_wrong_layer_and_a_nan():
    refs = FakeLayers().refs
    good = [T(r.a * (1 + 1e-3)) for r in refs]
    result = check(good, refs)
    assert result["ok"] and result["rel_err"] == pytest.approx(1e-3) and result["layers_checked"] == 3
    # Outputs hash alike exactly when they hold the same values.
    assert check([T(r.a * (1 + 1e-3)) for r in refs], refs)["digest"] == result["digest"]
    other = [T(r.a * (1 + 1e-3)) for r in refs]
    other[1].a[0, 0, 0] = np.nextafter(other[1].a[0, 0, 0], np.inf)
    assert check(other, refs)["digest"] != result["digest"]
    bad = [T(r.a) for r in refs]
    bad[2].a[0, 0, 0] += 0.1 * 3  # 10% of the third layer's max
    assert not check(bad, refs)["ok"] and check(bad, refs)["rel_err"] == pytest.approx(0.1)
    poison(bad[:1])
    assert check(bad, refs) == {"ok": False, "rel_err": None, "max_abs_err": None, "nonfinite_output": True,
                                "layers_checked": 3, "tolerance": 1e-2}
    with pytest.raises(ValueError):
        check(bad[:2], refs)


def test_a_right_case_is_prepared_and_a_wrong_one_gets_no_figure():
    layers = FakeLayers()
    entry, ready = prepare("good", writer, layers, FakeHarness(), NO_GRAPH)
    assert entry["status"] == "ok" and entry["check"]["ok"] and ready is not None and ready.skipped == {}
    entry, ready = prepare("bad", lambda l: writer(l, wrong_layer=1), layers, FakeHarness(), NO_GRAPH)
    assert entry["status"] == "wrong" and ready is None and entry["check"]["rel_err"] == pytest.approx(0.5)


def test_outputs_are_poisoned_before_the_checked_calls():
    # A case that writes nothing into layer 0 on its second pass: the first pass's right values
    # must not pass for its output.
    layers = FakeLayers()
    passes = {"n": 0}
    inner = writer(layers)

    def make(l):
        def first_call():
            passes["n"] += 1
            if passes["n"] == 1:
                inner.calls[0]()
        return Case([first_call, *inner.calls[1:]], inner.outputs)

    entry, ready = prepare("lazy", make, layers, FakeHarness(), NO_GRAPH)
    assert entry["status"] == "wrong" and entry["check"]["nonfinite_output"] and ready is None


def test_a_case_that_raises_is_reported_not_raised():
    def broken(layers):
        raise RuntimeError("no kernel for this shape\n(details)")

    entry, ready = prepare("broken", broken, FakeLayers(), FakeHarness(), NO_GRAPH)
    assert entry == {"status": "n/a", "reason": "RuntimeError: no kernel for this shape (details)"}
    assert ready is None


def test_no_graph_costs_the_serving_figure_only():
    # FakeHarness has no torch, so the capture fails: serving is skipped with the reason, the
    # other protocols still run.
    entry, ready = prepare("nograph", writer, FakeLayers(), FakeHarness(), Settings())
    assert entry["status"] == "ok" and ready is not None
    assert ready.skipped["serving"].startswith("no CUDA graph: ")
    assert ready.runs("flush") and ready.runs("eager")


def test_the_scope_is_entered_around_setup_and_calls():
    layers, depth, seen = FakeLayers(), [0], []

    class Scope:
        def __enter__(self):
            depth[0] += 1

        def __exit__(self, *exc):
            depth[0] -= 1

    def make(l):
        seen.append(("make", depth[0]))
        case = writer(l)
        calls = case.calls

        def first():
            seen.append(("call", depth[0]))
            calls[0]()
        case.calls = [first, *calls[1:]]
        return case

    prepare("scoped", make, layers, FakeHarness(), NO_GRAPH, scope=Scope)
    assert seen == [("make", 1), ("call", 1), ("call", 1)] and depth == [0]


def _ready(names):
    layers = FakeLayers()
    return [prepare(n, writer, layers, FakeHarness(), NO_GRAPH)[1] for n in names]


def test_rounds_alternate_per_protocol_and_pool_their_samples():
    ready = _ready(["A", "B"])
    log = []

    def fake_measure(p, protocol, harness, settings):
        log.append((protocol, p.name))
        return [10.0 + len(log)] * 3

    run_rounds(ready, FakeHarness(), Settings(rounds=4, protocols=("flush", "eager")), fake_measure)
    assert [n for proto, n in log if proto == "flush"] == list("ABBABAAB")
    assert [n for proto, n in log if proto == "eager"] == list("ABBABAAB")
    assert log[:4] == [("flush", "A"), ("flush", "B"), ("eager", "A"), ("eager", "B")]  # protocols within a round
    a = summary(ready[0], ("flush", "eager", "serving"))
    assert a["flush"]["n"] == 12 and len(a["flush"]["round_medians"]) == 4
    assert a["flush"]["round_medians"] == [11.0, 16.0, 20.0, 23.0]  # A ran 1st, 6th, 10th, 13th
    assert a["flush"]["median_us"] == pytest.approx(18.0)  # pooled: 3 samples per round
    assert a["serving"] == {"status": "n/a", "reason": "not timed"}


def test_a_failure_while_timing_drops_that_protocol_only():
    ready = _ready(["A", "B"])
    calls = {"n": 0}

    def flaky(p, protocol, harness, settings):
        calls["n"] += 1
        if p.name == "B" and protocol == "eager" and calls["n"] > 4:
            raise RuntimeError("illegal address")
        return [1.0]

    run_rounds(ready, FakeHarness(), Settings(rounds=3, protocols=("flush", "eager")), flaky)
    b = summary(ready[1], ("flush", "eager"))
    assert b["flush"]["status"] == "ok" and b["flush"]["n"] == 3
    assert b["eager"] == {"status": "n/a", "reason": "while timing: RuntimeError: illegal address"}
    assert summary(ready[0], ("eager",))["eager"]["n"] == 3


def test_round_spread():
    assert protocols.round_spread([10.0, 11.0, 12.0]) == pytest.approx(0.2 / 1.1)
    assert protocols.round_spread([10.0]) is None
    assert protocols.round_spread(None) is None
