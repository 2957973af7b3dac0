"""splitkv-gen: render and compile the decode kernels of one GPU architecture, without a GPU.

    splitkv-gen --arch sm90 [--head-dim 64,128] [--group 1,4,8] [--dtype bf16,fp16,fp8_e4m3,nvfp4]
                [--emit DIR] [--list] [--jobs N]
    splitkv-gen --arch sm90 --warm --head-dim 128 --group 4 --kv-heads 8 --max-len N [--max-batch N] [--gpu NAME]
    splitkv-gen --arch sm90 --tune [--head-dim ..] [--dtype ..] [--trials N] [--timeout S]
                [--storage URL] [--study NAME] [--devices 0,1] [--report DIR] [--out DIR]
    splitkv-gen --arch sm90 --tune --remeasure [--head-dim ..] [--bucket ..] [--iters N] [--out DIR]
    splitkv-gen bench [ARGS...]          # forwarded to `python -m splitkv.bench`

Heavy imports (the code generator, CuPy, the benchmark) happen inside the functions that need them,
so that `--help`, `--list` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

#: Lines of the NVRTC log shown for a failed kernel; the full log is one `--emit` or source away.
LOG_LINES = 12

#: Exit status when the reader of our output went away (`splitkv-gen --list | head -1`): what a
#: process killed by SIGPIPE reports to the shell.
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE is 13 (the signal module has no SIGPIPE on Windows)

_EPILOG = """\
subcommands:
  bench [ARGS...]   time decode attention against its peers; same as `python -m splitkv.bench`
                    (see `splitkv-gen bench --help`)

examples:
  splitkv-gen --arch sm90 --list
  splitkv-gen --arch sm90 --head-dim 128 --group 4,8 --emit build/kernels
  splitkv-gen --arch sm90 --tune --head-dim 128 --group 4 --storage tune.log --out my_tables
  splitkv-gen bench --help
"""


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("splitkv")
    except Exception:  # running from a source tree that was never installed
        return "0.1.0"


def _csv(kind):
    """argparse type for comma-separated values of `kind`; the option may also be repeated."""
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__} values, got {text!r}") from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    from splitkv.autotune.cli import add_arguments
    from splitkv.autotune.flags import path_arg

    p = argparse.ArgumentParser(
        prog="splitkv-gen",
        description="Render and compile splitkv's decode kernels for one GPU architecture.\n"
                    "NVRTC is given the target explicitly, so no GPU is needed.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arch", help="target architecture: sm80, sm_90, 90, sm_100a, ...")
    p.add_argument("--head-dim", dest="head_dims", type=_csv(int), action="append", metavar="D,...",
                   help="only these head dimensions")
    p.add_argument("--group", dest="group_sizes", type=_csv(int), action="append", metavar="G,...",
                   help="only these GQA group sizes (query heads per K/V head)")
    p.add_argument("--dtype", dest="kv_dtypes", type=_csv(str), action="append", metavar="T,...",
                   help="only these K/V dtypes")
    p.add_argument("--page-size", dest="page_sizes", type=_csv(int), action="append", metavar="P,...",
                   help="also (or, without 0, only) the programs for paged caches of these page sizes "
                        "(0: contiguous caches, the default)")
    p.add_argument("--layout", dest="kv_layout", choices=["NHD", "HND"], default="NHD",
                   help="the axis order of a page for --page-size (default NHD)")
    p.add_argument("--emit", type=path_arg, metavar="DIR",
                   help="write <name>.cu and <name>.cubin of every kernel built into DIR")
    p.add_argument("--list", action="store_true", help="list the kernel names only; compile nothing")
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="compile N kernels at a time (default: number of CPUs; with --tune and --devices, "
                        "shared among the workers)")
    p.add_argument("--warm", action="store_true",
                   help="compile what DecodeAttention.warmup would for --kv-heads, --max-len, --max-batch (and the "
                        "--gpu model's tuned table) into the kernel cache ($SPLITKV_CACHE_DIR), e.g. to ship a fleet")
    p.add_argument("--gpu", metavar="NAME", help="with --warm: the GPU model whose tuned table plans take "
                                                 "('NVIDIA H200'; default: the built-in choice only)")
    p.add_argument("--kv-heads", type=int, metavar="N", help="with --warm: K/V heads of the model")
    p.add_argument("--max-len", type=int, metavar="N", help="with --warm: the longest sequence plans will see")
    p.add_argument("--max-batch", type=int, default=1, metavar="N", help="with --warm: the largest batch (default 1)")
    p.add_argument("--tune", action="store_true",
                   help="measure candidate CTA shapes on this GPU (Optuna) and write the winners to a tuned table")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    add_arguments(p)
    return p


def _flatten(groups):
    """[[64, 128], [256]] -> (64, 128, 256), first occurrence wins; None stays None (no filter)."""
    if groups is None:
        return None
    seen = []
    for group in groups:
        for item in group:
            if item not in seen:
                seen.append(item)
    return tuple(seen)


def _check_filters(parser, arch, head_dims, group_sizes, kv_dtypes) -> str:
    """Validate against the spec vocabulary here, so a typo is a usage error and not a traceback."""
    from splitkv.arch import arch_number, parse_arch
    from splitkv.choices import HEAD_DIMS, KV_DTYPES, MAX_GROUP, QUANTIZED_KV_DTYPES

    try:
        arch = parse_arch(arch)
    except ValueError as e:
        # spec's message starts with the field name; the user typed an option.
        parser.error("--arch: " + str(e).removeprefix("arch: "))
    for d in head_dims or ():
        if d not in HEAD_DIMS:
            parser.error(f"--head-dim: {d} is not supported; choose from {list(HEAD_DIMS)}")
    for g in group_sizes or ():
        if not 1 <= g <= MAX_GROUP:
            parser.error(f"--group: {g} is out of range; expected 1..{MAX_GROUP}")
    for t in kv_dtypes or ():
        if t not in KV_DTYPES:
            parser.error(f"--dtype: {t!r} is not supported; choose from {list(KV_DTYPES)}")
        if t in QUANTIZED_KV_DTYPES and arch_number(arch) < 89:
            parser.error(f"--dtype: {t} K/V need sm_89 or newer (E4M3 conversions); got {arch}")
    return arch


class _Progress:
    """One line per finished kernel on stderr, or a tqdm bar when tqdm is there and stderr is a
    terminal (a bar in a log file is noise)."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="kernel", file=sys.stderr)
            except ImportError:
                pass

    def update(self, name: str, status: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
            self.bar.update(1)
            if status != "ok":
                self.bar.write(f"{name}: {status}", file=sys.stderr)
        else:
            width = len(str(self.total))
            print(f"[{self.done:>{width}}/{self.total}] {status:<6} {name}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def format_table(results) -> str:
    header = ("kernel", "registers", "spill bytes", "compile ms", "cubin bytes")
    rows = [(r.spec.name, _fmt(r.registers), _fmt(r.spill_bytes),
             _fmt(r.compile_ms) + (" (cached)" if getattr(r, "cached", False) else ""), _fmt(len(r.cubin)))
            for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        # Name left-aligned, numbers right-aligned so that magnitudes line up.
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def _describe_failure(name: str, exc: BaseException, codegen) -> str:
    lines = [f"FAILED {name}: {type(exc).__name__}"]
    if isinstance(exc, codegen.CompileError):
        log = (getattr(exc, "log", "") or str(exc)).strip().splitlines()
        source_path = getattr(exc, "source_path", None)
    else:
        # A render error (say a template parameter Jinja could not resolve) is reported the same
        # way, so one broken variant never hides the state of the others.
        log = str(exc).strip().splitlines()
        source_path = None
    shown = log[:LOG_LINES]
    lines += [f"    {text}" for text in shown]
    if len(log) > len(shown):
        lines.append(f"    ... ({len(log) - len(shown)} more lines)")
    lines.append(f"    source: {source_path if source_path else '(not written)'}")
    return "\n".join(lines)


def _compile_all(specs, jobs: int, codegen):
    """Compile every spec; return (results in spec order, failures as (name, exception))."""
    progress = _Progress(len(specs))
    outcomes = {}
    try:
        # NVRTC releases the GIL while it compiles, so threads give real parallelism and keep the
        # results as ordinary objects (no pickling of specs or cubins between processes).
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(codegen.compile_cubin, s): i for i, s in enumerate(specs)}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    outcomes[i] = fut.result()
                    progress.update(specs[i].name, "ok")
                except Exception as e:
                    outcomes[i] = e
                    progress.update(specs[i].name, "FAILED")
    finally:
        progress.close()
    results, failures = [], []
    for i, spec in enumerate(specs):
        out = outcomes[i]
        if isinstance(out, BaseException):
            failures.append((spec.name, out))
        else:
            results.append(out)
    return results, failures


def _prepare_emit_dir(parser, directory: Path) -> None:
    """Create --emit's folder and check it can be written before compiling, so that a bad path is a
    usage error at once rather than a traceback after every kernel has been built."""
    from splitkv.codegen.compile import make_writable_folder

    if directory.exists() and not directory.is_dir():
        parser.error(f"--emit: {directory} exists and is not a folder")
    try:
        make_writable_folder(directory)
    except OSError as e:
        parser.error(f"--emit: cannot write to {directory}: {e.strerror or e}")


def _check_compiler(compiler) -> str | None:
    """Why nothing can be compiled here (no NVRTC, no CUDA headers, no writable cache), or None.
    Asked once, so that the reason is said once and not once per kernel."""
    try:
        compiler.check_compiler()
        compiler.ensure_cache_dir()
    except (compiler.CompilerUnavailableError, compiler.CacheDirError) as e:
        return str(e)
    return None


def _emit(results, directory: Path, headers: dict[str, str]) -> int:
    """Sources, cubins and the helper headers the sources include: the folder compiles on its own."""
    for name, text in headers.items():
        (directory / name).write_text(text)
    for r in results:
        (directory / f"{r.spec.name}.cu").write_text(r.source)
        (directory / f"{r.spec.name}.cubin").write_bytes(r.cubin)
    return len(headers) + 2 * len(results)


def _run_bench(args) -> int:
    try:
        from splitkv import bench
    except ImportError as e:
        print(f"splitkv-gen bench: the benchmark could not be loaded: {e}", file=sys.stderr)
        return 2
    rc = bench.main(list(args))
    return 0 if rc is None else int(rc)


def main(argv=None) -> int:
    """The console script: `_main`, quiet when the reader of its output goes away early."""
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here, where a closed pipe can still be caught; at exit it prints a traceback.
            sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _warm_specs(parser, args, arch, head_dims, group_sizes, kv_dtypes, page_sizes) -> list:
    """--warm: `warmup.programs_to_warm` of every (head_dim, group, K/V dtype, page size) asked for;
    the queries are fp16 for fp16 caches and bf16 otherwise."""
    from splitkv import warmup
    from splitkv.tuned.keys import TuneKey

    if args.tune:
        parser.error("--warm does not go with --tune")
    if not head_dims or not group_sizes:
        parser.error("--warm: give the model's --head-dim and --group")
    if args.kv_heads is None or args.max_len is None:
        parser.error("--warm: give --kv-heads and --max-len (and --max-batch) of the plans to warm")
    specs = []
    for head_dim in head_dims:
        for group in group_sizes:
            for kv_dtype in kv_dtypes or ("bf16",):
                for page_size in page_sizes:
                    q_dtype = "fp16" if kv_dtype == "fp16" else "bf16"
                    key = TuneKey(head_dim, group, q_dtype, kv_dtype, page_size, args.kv_layout if page_size else "NHD")
                    found, entries = warmup.programs_to_warm(arch, args.gpu, key, args.kv_heads, args.max_batch,
                                                             args.max_len)
                    print(f"{key.label}: {len(found)} programs from {entries} tuned entries", file=sys.stderr)
                    specs += found
    return list(dict.fromkeys(specs))


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench` is dispatched before argparse: its options belong to the benchmark, and an argparse
    # subparser would make every other invocation name a subcommand too.
    if argv and argv[0] == "bench":
        return _run_bench(argv[1:])

    parser = build_parser()
    args = parser.parse_args(argv)

    args.argv = argv
    if args.arch is None:
        parser.error("--arch is required (for example --arch sm90)")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs: expected a positive number, got {args.jobs}")

    head_dims = _flatten(args.head_dims)
    group_sizes = _flatten(args.group_sizes)
    kv_dtypes = _flatten(args.kv_dtypes)
    page_sizes = _flatten(args.page_sizes) or (0,)
    arch = _check_filters(parser, args.arch, head_dims, group_sizes, kv_dtypes)
    from splitkv.choices import PAGE_SIZES

    for page_size in page_sizes:
        if page_size not in (0, *PAGE_SIZES):
            parser.error(f"--page-size: {page_size} is not supported; choose 0 (contiguous) or one of {list(PAGE_SIZES)}")
    if args.remeasure and not args.tune:
        parser.error("--remeasure goes with --tune: splitkv-gen --arch sm90 --tune --remeasure")
    if args.tune:
        from splitkv.autotune import cli as tune_cli

        return tune_cli.run(args, parser, arch, head_dims, group_sizes, kv_dtypes, page_sizes)

    from splitkv import codegen

    try:
        if args.warm:
            specs = _warm_specs(parser, args, arch, head_dims, group_sizes, kv_dtypes, page_sizes)
        else:
            for flag in ("gpu", "kv_heads", "max_len"):
                if getattr(args, flag) is not None:
                    parser.error(f"--{flag.replace('_', '-')} goes with --warm")
            specs = list(codegen.default_specs(arch, head_dims=head_dims, group_sizes=group_sizes,
                                               kv_dtypes=kv_dtypes, page_sizes=page_sizes, kv_layout=args.kv_layout))
    except ValueError as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    if not specs:
        print(f"splitkv-gen: no kernels match these filters for {arch}", file=sys.stderr)
        return 1

    if args.list:
        for s in specs:
            print(s.name)
        return 0

    if args.emit is not None:
        _prepare_emit_dir(parser, args.emit)
    from splitkv.codegen import compile as compiler

    problem = _check_compiler(compiler)
    if problem is not None:
        print(f"splitkv-gen: {problem}", file=sys.stderr)
        return 2

    jobs = args.jobs or os.cpu_count() or 1
    print(f"compiling {len(specs)} kernels for {arch} with {min(jobs, len(specs))} jobs",
          file=sys.stderr)
    start = time.perf_counter()
    results, failures = _compile_all(specs, jobs, codegen)
    wall = time.perf_counter() - start

    if results:
        print(format_table(results))
    emitted = True
    if args.emit is not None and results:
        try:
            written = _emit(results, args.emit, codegen.helper_headers())
            print(f"wrote {written} files to {args.emit}", file=sys.stderr)
        except OSError as e:  # the folder was checked before compiling; a full disk still shows here
            print(f"splitkv-gen: --emit: cannot write to {args.emit}: {e.strerror or e}", file=sys.stderr)
            emitted = False
    for name, exc in failures:
        print(_describe_failure(name, exc, codegen), file=sys.stderr)
    print(f"{len(results)} built, {len(failures)} failed in {wall:.1f} s", file=sys.stderr)
    return 1 if failures or not emitted else 0


if __name__ == "__main__":
    sys.exit(main())
