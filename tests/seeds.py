"""The test run's seed: one per run, drawn at random unless ``SPLITKV_TEST_SEED`` gives it.

Every random draw of the tests comes from it, so the seed that the pytest header prints replays a
run: ``SPLITKV_TEST_SEED=<seed> python -m pytest ...``. The conftest chooses it when the run starts
and exports it, so test modules, subprocesses and pytest-xdist workers all read the same one. Each
test's inputs are drawn from the seed and a key of its own (its parameters, its name), never from a
stream shared with other tests, so a replay gives a test the same inputs whatever else runs with
it, in whatever order.
"""

from __future__ import annotations

import os
import secrets
import zlib

import numpy as np

ENV = "SPLITKV_TEST_SEED"


def run_seed() -> int:
    """The run's seed: ``$SPLITKV_TEST_SEED``, else a fresh one, exported for whatever starts later."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        seed = secrets.randbelow(2**31)
        os.environ[ENV] = str(seed)
        return seed
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise ValueError(f"{ENV}: expected a non-negative integer, got {text!r}")
    return seed


def rng(*key) -> np.random.Generator:
    """A generator of its own for ``key`` (any values with a stable ``str``), drawn from the run's seed."""
    return np.random.default_rng([run_seed(), *(zlib.crc32(str(k).encode()) for k in key)])


def seed_of(*key) -> int:
    """A 32-bit seed for ``key``, for generators that take a plain integer (random, torch)."""
    return int(np.random.SeedSequence([run_seed(), *(zlib.crc32(str(k).encode()) for k in key)]).generate_state(1)[0])
