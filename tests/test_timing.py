"""CPU tests of the measuring primitives (`splitkv.timing`): statistics, the read floor's pure
parts and its kernel, the back-to-back protocol's arithmetic, and the layering."""

import ast
import math
import pathlib

import pytest

from nvrtc_ptx import ptx_for_sm90
from splitkv import timing
from splitkv.timing import floor

ROOT = pathlib.Path(__file__).resolve().parents[1] / "splitkv"


# ---- statistics ------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy_linear():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert timing.percentile(values, 50) == 3.0
    assert timing.percentile(values, 0) == 1.0
    assert timing.percentile(values, 100) == 5.0
    assert timing.percentile(values, 10) == pytest.approx(1.4)
    assert timing.percentile(values, 90) == pytest.approx(4.6)
    assert timing.percentile([1.0, 2.0], 50) == 1.5
    assert timing.percentile([7.0], 90) == 7.0
    np = pytest.importorskip("numpy")
    data = [float((i * 37) % 101) + 0.25 * i for i in range(200)]
    for q in (10, 25, 50, 75, 90):
        assert timing.percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        timing.percentile([], 50)
    with pytest.raises(ValueError):
        timing.percentile([1.0], 101)


def test_summarize():
    times = list(range(1, 101))  # 1..100 µs
    st = timing.summarize(times)
    assert st["n"] == 100
    assert st["median_us"] == pytest.approx(50.5)
    assert st["p10_us"] == pytest.approx(10.9)
    assert st["p90_us"] == pytest.approx(90.1)
    assert st["min_us"] == 1.0
    assert st["mean_us"] == pytest.approx(50.5)
    assert st["p10_us"] <= st["median_us"] <= st["p90_us"]
    with pytest.raises(ValueError):
        timing.summarize([])


def test_percentile_matches_math_for_even_count():
    assert timing.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert timing.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert math.isclose(timing.percentile([0.0, 10.0], 25), 2.5)


def test_gbps_is_decimal():
    assert timing.gbps(10**9, 1e6) == pytest.approx(1.0)
    assert timing.gbps(4 * 10**9, 1000.0) == pytest.approx(4000.0)


# ---- the read floor's pure parts --------------------------------------------------------------

def test_floor_vec_count_and_grid():
    assert floor.vec_count(0) == 0
    assert floor.vec_count(1) == 1
    assert floor.vec_count(16) == 1
    assert floor.vec_count(17) == 2
    assert floor.vec_count(2**30) == 2**26
    assert floor.grid_size(2**26, 132) == 132 * 8  # big reads fill every SM
    assert floor.grid_size(65536, 132) == 256  # 1 MiB: no CTA without a vector
    assert floor.grid_size(1, 132) == 1
    assert floor.grid_size(0, 132) == 1
    with pytest.raises(ValueError):
        floor.grid_size(10, 0)
    with pytest.raises(ValueError):
        floor.vec_count(-1)


def test_floor_kernel_compiles_for_sm90_without_a_gpu():
    ptx = ptx_for_sm90(floor.SOURCE, "floor.cu")
    for name in (floor.READ_KERNEL, floor.EMPTY_KERNEL):
        assert f".entry {name}" in ptx
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    assert loads and all(".v4." in line for line in loads)  # 16-byte loads only
    assert len(loads) >= 5  # four in flight in the main loop plus the tail loop
    assert "st.global" in ptx  # the reduction is stored, so the loads cannot be dropped


def test_floor_reader_checks_its_offset_and_capacity():
    # A ReadFloor without its GPU buffers: only the bounds logic of reader() runs.
    reads = floor.ReadFloor.__new__(floor.ReadFloor)
    reads.sm_count, reads.capacity_vecs = 132, 1024
    reads._buf, reads._sink, reads._read = bytearray(16 * 1024), None, None
    assert callable(reads.reader(8192, 8192))  # the last half: fits exactly
    with pytest.raises(ValueError, match="exceeds"):
        reads.reader(8192, 8208)
    with pytest.raises(ValueError, match="multiple of 16"):
        reads.reader(16, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        reads.reader(16, -16)


# ---- sequences: the eager protocol's arithmetic ------------------------------------------------

def test_back_to_back_makes_at_least_the_calls_asked():
    assert timing.back_to_back_count(128, 128) == 1
    assert timing.back_to_back_count(2, 128) == 64
    assert timing.back_to_back_count(3, 128) == 43  # 129 calls
    assert timing.back_to_back_count(500, 128) == 1
    with pytest.raises(ValueError):
        timing.back_to_back_count(0, 128)


def test_back_to_back_times_from_idle_to_synchronized_per_call():
    events, now = [], [0.0]

    def clock():
        events.append("clock")
        return now[0]

    def launcher(i):
        def call():
            events.append(i)
            now[0] += 3e-6  # each call costs 3 µs of host time
        return call

    def synchronize():
        events.append("sync")
        now[0] += 10e-6  # the GPU drains 10 µs after the last call

    per_call = timing.time_back_to_back([launcher(0), launcher(1)], samples=2, min_calls=5, synchronize=synchronize,
                                        clock=clock)
    # Warm-up: every call once, then a synchronize; then per sample: the clock, 3 passes of both
    # calls (6 >= 5 calls), the synchronize, the clock.
    sample = ["clock", 0, 1, 0, 1, 0, 1, "sync", "clock"]
    assert events == [0, 1, "sync"] + sample + sample
    assert per_call == pytest.approx([(6 * 3 + 10) / 6] * 2)


# ---- layering ----------------------------------------------------------------------------------

def _imports(path: pathlib.Path):
    """(module as written, level, names) of every import in a source file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, []


def test_the_timing_package_imports_nothing_else_of_splitkv():
    for path in (ROOT / "timing").glob("*.py"):
        for module, level, _ in _imports(path):
            assert level <= 1 and not module.startswith("splitkv"), (path.name, module, level)


def test_the_tuner_times_through_timing_and_never_imports_the_benchmark_cli():
    for path in (ROOT / "autotune").glob("*.py"):
        for module, level, names in _imports(path):
            absolute = module if level == 0 else "splitkv." + module if level == 2 else ""
            if absolute == "splitkv" or (level == 2 and module == ""):
                assert "bench" not in names, (path.name, names)  # the benchmark package as a whole
            if absolute.startswith("splitkv.bench"):
                assert absolute != "splitkv.bench" and not absolute.startswith("splitkv.bench.cli"), (path.name, absolute)
                assert path.name == "sweep.py", (path.name, absolute)  # the report's sweep times the peers
            if absolute.startswith(("splitkv.bench", "splitkv.timing")):
                assert not any(n.startswith("_") for n in names), (path.name, absolute, names)


def test_no_private_name_crosses_a_module_of_the_benchmark_or_timing():
    for folder in ("bench", "timing"):
        for path in (ROOT / folder).glob("*.py"):
            for module, level, names in _imports(path):
                if module != "__future__":
                    assert not any(n.startswith("_") for n in names), (path.name, module, names)
