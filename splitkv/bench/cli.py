"""``python -m splitkv.bench``: time splitkv beside its peers under three protocols, and render
what was measured.

    python -m splitkv.bench [run options]        # time (the default command)
    python -m splitkv.bench render --latest      # BENCHMARKS.md's figures from the latest results
    python -m splitkv.bench ab --latest          # the A/B table of a run with --baseline
    python -m splitkv.bench merge A.json B.json  # one results file of a sweep split by --part
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import math
import sys
import time
from pathlib import Path

from . import render, results
from .overrides import parse_spec_override, spec_label
from .peers import PEER_GROUPS, PEER_SETUPS, parse_peers
from .protocols import PROTOCOLS, Settings, positions_balanced
from .shapes import DEFAULT_SHAPES, QUICK_SHAPES, SERVING_BYTES, parse_shapes, serving_layers, shapes_part

SUBCOMMANDS = ("render", "ab", "merge")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m splitkv.bench",
        description="Time splitkv decode attention beside cuDNN and flash SDPA, FlashAttention-3 and FlashInfer "
                    "under the serving, flush and eager protocols, in alternating (ABBA) rounds, every output "
                    "checked first; also `render`, `ab` and `merge` (python -m splitkv.bench render --help).")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--shapes", nargs="+", metavar="B:Hq:Hkv:D:L",
                       help="shapes to time instead of the default set (L may be written 4k; :fp8 or :nvfp4 for a "
                            "quantized cache)")
    which.add_argument("--quick", action="store_true", help="a 3-shape subset of the default set")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="time only the I-th of N contiguous slices of the shapes (a sweep over N calls)")
    p.add_argument("--rounds", type=int, default=5, help="ABBA rounds (default 5)")
    p.add_argument("--protocols", default=",".join(PROTOCOLS),
                   help=f"comma list of {', '.join(PROTOCOLS)} (default all)")
    p.add_argument("--iters", type=int, default=200,
                   help="flush protocol: timed calls per figure, spread over the rounds (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="flush protocol: untimed calls before each round's")
    p.add_argument("--replays", type=int, default=20, help="serving protocol: graph replays per round (default 20)")
    p.add_argument("--eager-samples", type=int, default=10, help="eager protocol: samples per round (default 10)")
    p.add_argument("--eager-calls", type=int, default=128,
                   help="eager protocol: calls per sample at the least (default 128)")
    p.add_argument("--serving-mb", type=int, default=SERVING_BYTES >> 20,
                   help=f"K/V MiB that the serving layers hold together at the least (default {SERVING_BYTES >> 20})")
    p.add_argument("--specs", nargs="+", action="extend", default=[], metavar="FIELD=V,...",
                   help="KernelSpec overrides to time beside splitkv's own choice, e.g. warps=8,tile_tokens=16: "
                        "fields replaced in splitkv's built-in CTA shape (variant= is handed to plan())")
    p.add_argument("--peers", default="all",
                   help="all (default), none, or a comma list of " + ", ".join(list(PEER_SETUPS) + list(PEER_GROUPS)))
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="another checkout of the project (a git worktree, or a git archive with a COMMIT file), "
                        "imported beside this one and timed in the same rounds")
    p.add_argument("--baseline-commit", default=None, help="the baseline's commit, where its directory cannot say")
    p.add_argument("--aa", action="store_true",
                   help="also time a second copy of the baseline (of this tree without --baseline): the A/A noise")
    p.add_argument("--flush-mb", type=int, default=256,
                   help="L2 flush buffer in MiB (default 256; raised to 2x the L2 when smaller)")
    p.add_argument("--copy-mb", type=int, default=1024,
                   help="device-to-device copy size for the bandwidth ceiling in MiB (default 1024)")
    p.add_argument("--floor-sweep", action="store_true",
                   help="also time an empty kernel and the read floor at 1 MiB .. 1 GiB")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="start no shape after SECONDS from the start; the rest is listed as not run")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="directory for the JSON result (default bench/results/ of the checkout)")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON result")
    p.add_argument("--commit", default=None,
                   help="commit to record when running from a copy of the checkout without git "
                        "(default: git rev-parse --short HEAD, or 'unknown')")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="append the figures section (GPU, date, commit, tables) to FILE")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
        args.shape_list = shapes_part(shapes, args.part) if args.part else shapes
        args.spec_overrides = [parse_spec_override(s) for s in args.specs]
        args.peer_list = parse_peers(args.peers)
        args.protocol_list = _protocols(args.protocols)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("iters", "rounds", "replays", "eager_samples", "eager_calls", "serving_mb", "flush_mb", "copy_mb"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be non-negative")
    if not args.shape_list:
        parser.error(f"--part {args.part}: no shape falls in it")
    if args.baseline_commit and args.baseline is None:
        parser.error("--baseline-commit goes with --baseline")
    return args


def _protocols(text: str) -> tuple:
    chosen = tuple(p.strip() for p in str(text).split(",") if p.strip())
    unknown = [p for p in chosen if p not in PROTOCOLS]
    if unknown or not chosen:
        raise ValueError(f"protocols: expected a comma list of {', '.join(PROTOCOLS)}, got {text!r}")
    return tuple(p for p in PROTOCOLS if p in chosen)


def settings_of(args) -> Settings:
    return Settings(rounds=args.rounds, iters=math.ceil(args.iters / args.rounds), replays=args.replays,
                    eager_samples=args.eager_samples, eager_min_calls=args.eager_calls,
                    protocols=args.protocol_list, serving_bytes=args.serving_mb << 20)


def _print(text: str = ""):
    print(text, flush=True)


def checkouts_of(args, commit: str) -> list:
    """(name, Checkout) of --baseline and --aa; CheckoutError or ImportError when one cannot load."""
    from .checkout import Checkout

    out = []
    if args.baseline is not None:
        out.append(("baseline", Checkout(args.baseline, "splitkv_baseline", args.baseline_commit)))
        if args.aa:
            out.append(("baseline-aa", Checkout(args.baseline, "splitkv_baseline_aa", args.baseline_commit)))
    elif args.aa:
        root = Path(__file__).resolve().parents[2]
        out.append(("splitkv-aa", Checkout(root, "splitkv_aa", commit)))
    return out


def run(args, argv) -> int:
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # a console that cannot encode 'µ' must not end a run
    started = time.monotonic()
    try:
        import cupy
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        cupy.cuda.Device().attributes  # noqa: B018 - fails early without a usable GPU
    except Exception as exc:  # noqa: BLE001
        _print(f"error: the benchmark needs a CUDA GPU, CuPy and torch (CUDA graphs, the peers): {exc}")
        return 1
    import splitkv

    from .. import timing
    from .cases import floor_capacity
    from .checkout import CheckoutError
    from .runner import bench_shape, free_memory, implementations

    now = _dt.datetime.now(_dt.timezone.utc)
    commit, dirty = (args.commit, None) if args.commit else results.git_commit()
    torch.cuda.set_device(cupy.cuda.Device().id)
    gpu = timing.gpu_info()
    gpu["cluster_layout"] = results.cluster_layout_or_none(gpu["arch"])
    try:
        checkouts = checkouts_of(args, commit)
    except Exception as exc:  # noqa: BLE001 - CheckoutError, or whatever the other tree raised
        kind = "" if isinstance(exc, CheckoutError) else f"{type(exc).__name__}: "
        _print(f"error: the checkout could not be imported: {kind}{exc}")
        return 2
    settings = settings_of(args)
    flush_bytes = max(args.flush_mb << 20, 2 * gpu["l2_bytes"])
    result = {
        "schema": results.SCHEMA, "gpu": gpu, "software": results.software_info(torch),
        "date": now.strftime("%Y-%m-%d"), "timestamp": now.isoformat(timespec="seconds"),
        "commit": commit, "dirty": dirty, "argv": results.portable_argv(argv),
        "protocol": {"protocols": list(settings.protocols), "rounds": settings.rounds, "iters": settings.iters,
                     "warmup": args.warmup, "flush_bytes": flush_bytes, "replays": settings.replays,
                     "eager_samples": settings.eager_samples, "eager_min_calls": settings.eager_min_calls,
                     "serving_bytes": settings.serving_bytes, "seed": args.seed, "dtype": "bf16"},
        "specs": [spec_label(o) for o in args.spec_overrides], "copy": None, "shapes": [], "not_run": [],
    }
    json_path = None
    if not args.no_json:
        base = next((c.commit for name, c in checkouts if name == "baseline"), None)
        json_path = results.unique_path(args.out if args.out is not None else results.default_results_dir(),
                                        results.result_filename(gpu["name"], result["date"], commit, base, args.part))

    def save():
        if json_path is not None:
            results.write_json(result, json_path)

    _print(f"{gpu['name']}: {gpu['sm_count']} SMs, {gpu['arch']}, L2 {gpu['l2_bytes'] / 2**20:.0f} MiB, "
           f"driver {gpu['driver_version'] or '?'} (CUDA {gpu['driver_cuda_version']}); commit {commit}"
           + (" (uncommitted changes)" if dirty else ""))
    for name, c in checkouts:
        _print(f"{name}: commit {c.commit} from {c.root.name}/ as {c.alias}")
    if gpu["cluster_layout"] is not None:
        _print(results.describe_cluster_layout(gpu["cluster_layout"]))

    harness = timing.Harness(settings.iters, args.warmup, flush_bytes, torch)
    with harness.active():
        harness.flush_us = harness.flush_time_us()
        result["protocol"]["flush_us"] = harness.flush_us
        try:  # the copy ceiling first, its 2 GiB freed before the shapes allocate
            result["copy"] = timing.copy_bandwidth(harness, args.copy_mb << 20, args.iters)
            _print(f"copy bandwidth: {result['copy']['gbps']:.0f} GB/s ({args.copy_mb} MiB device-to-device, "
                   f"read + written)")
        except Exception as exc:  # noqa: BLE001
            result["copy"] = {"status": "n/a", "reason": str(exc)[:400]}
            _print(f"copy bandwidth: n/a ({exc})")
        free_memory(torch)
        copy_gbps = (result["copy"] or {}).get("gbps")
        capacity = max([floor_capacity(s, serving_layers(s, settings.serving_bytes)) for s in args.shape_list]
                       + ([1 << 30] if args.floor_sweep else []))
        floor = timing.ReadFloor(capacity, gpu["sm_count"])
        if args.floor_sweep:
            result["floor_sweep"] = floor_sweep(harness, floor)
        impls = implementations(splitkv, floor, args.peer_list, args.spec_overrides, gpu["arch"], commit, checkouts)
        result["implementations"] = {impl.name: impl.record for impl in impls}
        if not positions_balanced(settings.rounds, len(impls)):
            _print(f"note: {settings.rounds} rounds do not give the {len(impls)} implementations every position "
                   f"equally often; a multiple of {2 * len(impls)} does (call order moves short shapes' figures)")
        save()
        total = len(args.shape_list)
        for i, shape in enumerate(args.shape_list, 1):
            if args.deadline is not None and time.monotonic() - started > args.deadline:
                result["not_run"] = [s.token for s in args.shape_list[i - 1:]]
                _print(f"deadline: {len(result['not_run'])} shapes not run: {' '.join(result['not_run'])}")
                break
            entry = bench_shape(shape, impls, harness, settings, args.seed, copy_gbps)
            result["shapes"].append(entry)
            save()
            _print(render.progress_line(i, total, entry, result))
    _print()
    _print(render.render_text(result))
    if json_path is not None:
        _print(f"results: {json_path}")
    if args.markdown is not None:
        append_markdown(render.render_markdown(result), args.markdown)
        _print(f"markdown section appended to {args.markdown}")
    return 0


def floor_sweep(harness, floor) -> list:
    """An empty kernel and the read floor at 1 MiB .. 1 GiB, flush protocol."""
    from ..timing import gbps, summarize

    sweep = [dict(summarize(harness.time(floor.empty())), bytes=0, what="empty kernel")]
    for mib in (1, 4, 16, 64, 256, 1024):
        stats = summarize(harness.time(floor.reader(mib << 20)))
        sweep.append(dict(stats, bytes=mib << 20, what=f"read {mib} MiB", gbps=gbps(mib << 20, stats["median_us"])))
    _print("read floor: " + "; ".join(f"{e['what']} {render.fmt_us(e['median_us'])} µs" for e in sweep))
    return sweep


def append_markdown(section: str, path: Path) -> Path:
    """Append ``section`` to ``path`` (created when missing), separated by a blank line."""
    path = Path(path)
    if path.exists() and path.stat().st_size > 0:
        existing = path.read_text(encoding="utf-8")
        sep = "" if existing.endswith("\n\n") else ("\n" if existing.endswith("\n") else "\n\n")
        with open(path, "a", encoding="utf-8") as f:
            f.write(sep + section)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(section, encoding="utf-8")
    return path


# ---- render, ab, merge ------------------------------------------------------------------------

def _source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", type=Path, help="a results file (or --latest)")
    p.add_argument("--latest", action="store_true", help="the latest results file of --dir (by its timestamp; "
                   "render: of a run with peers, ab: of one with --baseline)")
    p.add_argument("--dir", type=Path, default=None, help="results folder (default bench/results/ of the checkout)")
    p.add_argument("--gpu", default=None, help="with --latest: the latest of this GPU (e.g. 'NVIDIA H200')")


def _source(p: argparse.ArgumentParser, args, timing: str) -> dict:
    """The results file named, or with --latest the latest of the folder that timed ``timing``
    ('peers': the current figures; 'checkouts': an A/B)."""
    if (args.file is None) == (not args.latest):
        p.error("give a results file or --latest (one of them)")
    try:
        path = args.file or results.latest_result(args.dir or results.default_results_dir(), args.gpu, timing)
        return results.load_result(path)
    except ValueError as exc:
        p.error(str(exc))


def render_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m splitkv.bench render",
                                description="The figures section of BENCHMARKS.md from a results file.")
    _source_arguments(p)
    p.add_argument("--text", action="store_true", help="terminal tables instead of markdown")
    p.add_argument("--heading", default="###",
                   help="markdown level of the section's heading (default ###: under a '## Current figures'; "
                        "the protocols' headings one deeper)")
    p.add_argument("--write", type=Path, default=None, metavar="FILE",
                   help=f"replace what lies between the markers in FILE ({render.BEGIN_MARKER} ... "
                        f"{render.END_MARKER}) instead of printing")
    args = p.parse_args(argv)
    result = _source(p, args, timing="peers")
    if not args.heading or set(args.heading) != {"#"}:
        p.error(f"--heading: expected one or more '#', got {args.heading!r}")
    section = render.render_text(result) if args.text else render.render_markdown(result, args.heading)
    if args.write is None:
        sys.stdout.write(section)
        return 0
    try:
        text = render.replace_section(args.write.read_text(encoding="utf-8"), section)
    except (OSError, ValueError) as exc:
        p.error(f"{args.write}: {exc}")
    args.write.write_text(text, encoding="utf-8")
    return 0


def ab_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m splitkv.bench ab",
                                description="Old against new median per shape and protocol, with the A/A spread.")
    _source_arguments(p)
    p.add_argument("--old", default=None, help="old side (default: the --baseline checkout)")
    p.add_argument("--new", default=None, help="new side (default: splitkv, this tree)")
    p.add_argument("--aa", default=None, help="the old side's second copy (default: the run's --aa one)")
    p.add_argument("--text", action="store_true", help="terminal tables instead of markdown")
    args = p.parse_args(argv)
    result = _source(p, args, timing="checkouts")
    try:
        old = args.old or render.default_ab_names(result)[0]
        if old is None:
            p.error("the results have no checkout to compare with (run with --baseline DIR, or give --old)")
        sys.stdout.write(render.render_ab(result, old, args.new, args.aa, markdown=not args.text))
    except ValueError as exc:
        p.error(str(exc))
    return 0


def merge_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m splitkv.bench merge",
                                description="One results file of the parts of one sweep (--part, or --shapes).")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="the merged file (default: bench/results/<gpu>-<date>-<commit>[-vs-<baseline>].json)")
    args = p.parse_args(argv)
    try:
        merged = results.merge_results([results.load_result(f) for f in args.files])
    except ValueError as exc:
        p.error(str(exc))
    output = args.output
    if output is None:
        base = (merged.get("implementations") or {}).get("baseline", {}).get("commit")
        output = results.unique_path(results.default_results_dir(), results.result_filename(
            merged["gpu"]["name"], merged["date"], merged["commit"], base))
    print(results.write_json(merged, output))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return {"render": render_main, "ab": ab_main, "merge": merge_main}[argv[0]](argv[1:])
    args = parse_args(argv)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
