"""Progress of a tuning run on stderr: a tqdm bar on a terminal, plain lines in a log."""

from __future__ import annotations

import sys
import time


def progress_bar(enabled: bool, **kwargs):
    """A tqdm bar on a terminal's stderr; plain lines (`PlainProgress`) where stderr is a file or a
    pipe, whose log a redrawn bar would fill with control characters; None when not enabled."""
    if not enabled:
        return None
    if sys.stderr.isatty():
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm comes with Optuna; without it, the plain lines
            pass
        else:
            return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)
    return PlainProgress(kwargs.get("desc") or "progress", kwargs.get("total"), kwargs.get("initial", 0))


class PlainProgress:
    """The part of tqdm's interface the tuner uses, as a line on stderr each time another tenth of
    ``total`` is done (and at the end): 'all studies: 120/360 (33%), 41 s'."""

    def __init__(self, desc: str, total: int | None, initial: int = 0):
        self.desc, self.total, self.n = desc, total, initial
        self._started = time.monotonic()
        self._tenths = self._tenth()
        self._postfix = ""

    def _tenth(self) -> int:
        return 10 * self.n // self.total if self.total else 0

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        """A line when the count has passed another tenth of the total since the last one."""
        if self._tenth() > self._tenths:
            self._tenths = self._tenth()
            self._line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self._postfix = text

    def close(self) -> None:
        if self.total is None or self._tenths < 10:
            self._line()

    def _line(self) -> None:
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        postfix = f", {self._postfix}" if self._postfix else ""
        print(f"{self.desc}: {count}{share}, {time.monotonic() - self._started:.0f} s{postfix}", file=sys.stderr,
              flush=True)
