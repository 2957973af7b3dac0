"""Cold start: what the first plan() costs with an empty kernel cache, what a warm-up costs, and the
first plan() of a process that starts from a warmed cache (read-only where the host allows).

    python bench/cold_start.py --json results.json        # on a GPU host; each step a fresh process
    python bench/cold_start.py --markdown results.json    # the BENCHMARKS.md section

Each step runs in a new Python process with its own ``SPLITKV_CACHE_DIR`` so that nothing is kept in
memory between them: (1) an empty cache, DecodeAttention() and its first plan(); (2) an empty cache,
DecodeAttention() and warmup() over the range; (3) the cache (2) left, made read-only, opened by a
process that may not write it (another user where this one is root), DecodeAttention(), the first
plan() and then random plans of the range, with NVRTC replaced by an error: any compile fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "batch": 16, "seq_len": 4096,
          "max_len": 131072, "max_batch": 256}

_STEP = r"""
import json, sys, time
start = time.perf_counter()
import numpy as np
import splitkv
import splitkv.codegen.compile as compile_module
config, step = json.loads(sys.argv[1]), sys.argv[2]
compiles = []
if step == "warmed":
    def refused(*args, **kwargs):
        raise AssertionError("a plan compiled after the warm-up")
    compile_module._compile = refused
else:  # counted: what the step really compiled
    nvrtc = compile_module._compile
    def counted(*args, **kwargs):
        compiles.append(1)
        return nvrtc(*args, **kwargs)
    compile_module._compile = counted
imported = time.perf_counter()
attn = splitkv.DecodeAttention(config["num_qo_heads"], config["num_kv_heads"], config["head_dim"])
built = time.perf_counter()
result = {"import_s": imported - start, "construct_s": built - imported}
if step == "warmup":
    report = attn.warmup(config["max_len"], config["max_batch"])
    result.update(warmup_s=time.perf_counter() - built, programs=report.programs, compiled=report.compiled,
                  tuned_entries=report.tuned_entries)
else:
    attn.plan([config["seq_len"]] * config["batch"])
    result["first_plan_s"] = time.perf_counter() - built
    if step == "warmed":
        rng = np.random.default_rng(0)
        t = time.perf_counter()
        for _ in range(200):
            batch = int(rng.integers(1, config["max_batch"] + 1))
            lens = rng.integers(1, config["max_len"] + 1, size=batch) if rng.random() < 0.5 else \
                np.full(batch, int(rng.integers(1, config["max_len"] + 1)))
            variant = "units" if rng.random() < 0.2 else None
            attn.plan(lens.tolist(), variant=variant)
        result["random_plans"] = 200
        result["random_plans_s"] = time.perf_counter() - t
result["nvrtc_compiles"] = len(compiles)
print(json.dumps(result))
"""


def _step(step: str, cache: Path, *, user: str | None = None) -> dict:
    env = dict(os.environ, SPLITKV_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(sys.path))
    command = [sys.executable, "-c", _STEP, json.dumps(CONFIG), step]
    if user is not None:
        command = ["runuser", "-u", user, "--", "env", f"SPLITKV_CACHE_DIR={cache}",
                   f"PYTHONPATH={env['PYTHONPATH']}", "HOME=/tmp", *command]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{done.stdout}\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def measure() -> dict:
    import cupy

    from splitkv.timing.device import gpu_info

    root = Path(tempfile.mkdtemp(prefix="splitkv-cold-"))
    try:
        cold = _step("cold", root / "cold")
        warm_cache = root / "warm"
        warmup = _step("warmup", warm_cache)
        for path in [warm_cache, *warm_cache.rglob("*")]:  # read-only for everyone
            path.chmod(path.stat().st_mode & 0o555)
        root.chmod(0o755)
        user = "nobody" if os.geteuid() == 0 and shutil.which("runuser") else None
        read_only = "read-only folder, opened by another user" if user else "read-only folder"
        try:
            warmed = _step("warmed", warm_cache, user=user)
        except SystemExit as failed:  # another user may not reach the GPU or the interpreter here
            if user is None:
                raise
            print(f"as {user}: {failed}; again as this user", file=sys.stderr)
            warmed, read_only = _step("warmed", warm_cache), "read-only folder (as root, which may write anyway)"
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)
    info = gpu_info()
    return {"gpu": info["name"], "cpus": os.cpu_count(), "config": CONFIG, "cold": cold, "warmup": warmup,
            "warmed": warmed, "warmed_cache": read_only, "cupy": cupy.__version__,
            "date": time.strftime("%Y-%m-%d")}


def markdown(result: dict) -> str:
    c = result["config"]
    cold, warmup, warmed = result["cold"], result["warmup"], result["warmed"]
    layout = f"{c['num_qo_heads']}/{c['num_kv_heads']} heads, D={c['head_dim']}, BF16"
    lines = [
        f"{result['gpu']}, {result['cpus']} CPUs, {layout}; every step a fresh process ({result['date']}).",
        "",
        "| step | time |",
        "|---|---:|",
        f"| first plan() of {c['batch']} x {c['seq_len']}, empty cache: {cold.get('nvrtc_compiles', '?')} programs "
        f"compiled | {cold['first_plan_s']:.2f} s |",
        f"| warmup(max_len={c['max_len']}, max_batch={c['max_batch']}), empty cache: {warmup['programs']} programs, "
        f"{warmup['tuned_entries']} tuned entries | {warmup['warmup_s']:.2f} s |",
        f"| first plan() after it, {result['warmed_cache']}, no compile | {warmed['first_plan_s'] * 1e3:.1f} ms |",
        f"| {warmed['random_plans']} random plans of the range after it, no compile | "
        f"{warmed['random_plans_s'] / warmed['random_plans'] * 1e3:.2f} ms each |",
        f"| import splitkv; DecodeAttention() | {cold['import_s'] + cold['construct_s']:.2f} s |",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="measure, and write the result here")
    parser.add_argument("--markdown", type=Path, help="print the BENCHMARKS.md section of a result file")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    result = measure()
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
