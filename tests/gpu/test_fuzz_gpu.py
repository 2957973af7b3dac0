"""A bounded slice of the fuzz run (tests/gpu/fuzz.py, marker: gpu): random cases over the fixed
programs, in 8 parts that run in parallel under xdist, each over its share of the programs. The
whole run (2,000 cases and more) is ``python tests/gpu/fuzz.py``; see the README."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from decode_checks import fresh_seed  # noqa: E402
from fuzz import PROGRAMS, run_cases  # noqa: E402

pytestmark = pytest.mark.gpu

PARTS, CASES_PER_PART = 8, 25


@pytest.mark.parametrize("part", range(PARTS))
def test_random_cases_match_the_reference(part):
    summary = run_cases(PROGRAMS[part::PARTS], CASES_PER_PART, fresh_seed(7000 + part))
    print(f"part {part}: {summary['cases']} cases in {summary['seconds']} s over {sorted(summary['per_program'])}")
    assert summary["cases"] == CASES_PER_PART
    assert summary["failed"] == 0, "\n".join(f"{f['case']}\n{f['error'][:1500]}" for f in summary["failures"][:5])
