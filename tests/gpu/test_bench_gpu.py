"""The benchmark on a real GPU, small: every protocol gives splitkv a figure, a second copy of this
tree imported beside it (the A/A path of --baseline) runs the same programs, a wrong output gets
no figure, and the results file renders."""

import json

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from splitkv import timing  # noqa: E402
from splitkv.bench import cli, render, results  # noqa: E402
from splitkv.bench.cases import Case, floor_case  # noqa: E402
from splitkv.bench.inputs import Layers  # noqa: E402
from splitkv.bench.protocols import Settings, measure, prepare  # noqa: E402
from splitkv.bench.shapes import parse_shape  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]  # times kernels: the GPU to itself

SMALL = ["--rounds", "2", "--iters", "20", "--replays", "5", "--eager-samples", "3", "--eager-calls", "16",
         "--serving-mb", "32", "--warmup", "3", "--copy-mb", "64", "--flush-mb", "128"]


def test_a_small_run_times_every_protocol_and_a_second_copy_of_the_tree(tmp_path, capsys):
    argv = ["--shapes", "1:32:8:128:1k", "1:32:8:128:4k:fp8", "--peers", "sdpa-cudnn,fa3", "--aa",
            "--out", str(tmp_path), "--commit", "0000000", *SMALL]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    result = results.load_result(path)
    assert list(result["implementations"]) == ["splitkv", "splitkv-aa", "sdpa-cudnn", "fa3", "floor"]
    assert result["implementations"]["splitkv-aa"]["tree"] == "checkout"
    assert [s["layers"] for s in result["shapes"]] == [8, 4]  # 32 MiB of K/V: 4 MiB, 8 MiB a layer
    for shape in result["shapes"]:
        impls = shape["implementations"]
        for name in ("splitkv", "splitkv-aa", "floor"):
            assert impls[name]["status"] == "ok", (shape["label"], name, impls[name])
            for protocol in ("serving", "flush", "eager"):
                fig = impls[name]["protocols"][protocol]
                assert fig["status"] == "ok" and fig["median_us"] > 0 and len(fig["round_medians"]) == 2, (name, fig)
        for name in ("splitkv", "splitkv-aa"):
            assert impls[name]["check"]["ok"] and impls[name]["check"]["layers_checked"] == shape["layers"]
            assert impls[name]["serving_check"]["ok"]
            # Two copies of one tree plan the same programs.
            assert impls[name]["info"]["plan_info"] == impls["splitkv"]["info"]["plan_info"]
        assert impls["sdpa-cudnn"]["status"] in ("ok", "n/a")
        assert impls["fa3"]["status"] in ("ok", "n/a")  # n/a where fa3-fwd is not installed
    bf16 = result["shapes"][0]["implementations"]
    assert bf16["sdpa-cudnn"]["status"] == "ok", bf16["sdpa-cudnn"]
    assert result["shapes"][1]["implementations"]["sdpa-cudnn"]["reason"].startswith("SDPA reads bf16")
    assert "Serving: µs per layer" in out and "results: " in out
    assert "### A/B" in render.render_ab(result)
    json.dumps(result)


def _layers(token="1:32:8:128:1k", count=3):
    return Layers(parse_shape(token), count, seed=1, torch_mod=torch)


def test_a_wrong_output_gets_no_figure_and_a_right_one_passes_the_graph_check():
    harness = timing.Harness(10, 2, 128 << 20, torch)
    with harness.active():
        layers = _layers()

        def copying(scale):
            def make(l):
                outs = [torch.empty_like(q) for q in l.q]

                def launcher(i):
                    ref = l.reference()[i]

                    def call():
                        outs[i].copy_((ref * scale).to(torch.bfloat16))
                    return call
                return Case([launcher(i) for i in range(l.count)], lambda: outs)
            return make

        entry, ready = prepare("right", copying(1.0), layers, harness, Settings(rounds=1))
        assert entry["status"] == "ok" and entry["serving_check"]["ok"] and ready.graph is not None
        entry, ready = prepare("wrong", copying(1.1), layers, harness, Settings(rounds=1))
        assert entry["status"] == "wrong" and ready is None


def test_the_floor_reads_each_layers_own_bytes_in_a_graph():
    harness = timing.Harness(10, 2, 128 << 20, torch)
    with harness.active():
        layers = _layers(count=4)
        reads = timing.ReadFloor(4 * layers.shape.total_bytes + 64)
        entry, ready = prepare("floor", lambda l: floor_case(reads, l), layers, harness, Settings(rounds=1))
        assert entry["status"] == "ok" and ready.graph is not None and "check" not in entry
        serving = measure(ready, "serving", harness, Settings(replays=3))
        eager = measure(ready, "eager", harness, Settings(eager_samples=2, eager_min_calls=8))
        assert len(serving) == 3 and len(eager) == 2 and min(serving + eager) > 0
