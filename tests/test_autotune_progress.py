"""The tuner's progress: a tqdm bar on a terminal, plain lines in a log (CPU only)."""

from __future__ import annotations

import io

import pytest

from splitkv.autotune import progress


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_a_log_gets_a_plain_line_per_tenth_and_at_the_end(monkeypatch):
    err = _Stderr(tty=False)
    monkeypatch.setattr(progress.sys, "stderr", err)
    bar = progress.progress_bar(True, total=40, desc="all studies", position=0)
    assert isinstance(bar, progress.PlainProgress)
    for _ in range(39):
        bar.update(1)
    bar.set_postfix_str("d128-g4 b1-l2k")
    bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"all studies: {4 * i}/40 ({10 * i}%)" for i in range(1, 11)]
    assert lines[-1].endswith("d128-g4 b1-l2k") and "\r" not in err.getvalue() and "\x1b" not in err.getvalue()


def test_a_bar_closed_early_or_without_a_total_says_where_it_stopped(monkeypatch):
    err = _Stderr(tty=False)
    monkeypatch.setattr(progress.sys, "stderr", err)
    bar = progress.progress_bar(True, total=100, initial=30, desc="d128-g4")
    bar.update(5)  # 35: no new tenth
    bar.close()
    assert err.getvalue().splitlines() == [err.getvalue().splitlines()[0]]
    assert err.getvalue().startswith("d128-g4: 35/100 (35%), ")
    open_ended = progress.progress_bar(True, desc="re-measured")
    open_ended.n = 7  # as the workers' overall bar is set
    open_ended.refresh()
    open_ended.close()
    assert err.getvalue().splitlines()[-1].startswith("re-measured: 7, ")


def test_a_terminal_gets_tqdm_and_a_disabled_bar_is_none(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(progress.sys, "stderr", _Stderr(tty=True))
    bar = progress.progress_bar(True, total=3, desc="x")
    assert isinstance(bar, tqdm.tqdm)
    bar.close()
    assert progress.progress_bar(False, total=3) is None
