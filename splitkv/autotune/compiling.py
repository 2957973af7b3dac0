"""Candidates' programs compiled on a thread pool while the search measures what is ready.

NVRTC releases the GIL, so ``objective.jobs`` threads compile at once while the main thread plans
and times candidates on the GPU; each program (a candidate, or one its plans load) is compiled
once per `Compiler`, however many candidates need it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class Compiler:
    """`submit` a candidate's programs (``objective.programs``, compiled by ``objective.compile``);
    `ready` says when they are done, `failure` why one of them failed. A program that failed for
    good (``objective.failure_is_final``) is not compiled again; one that failed otherwise is, when
    the next candidate needs it."""

    def __init__(self, objective):
        self.objective = objective
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(objective.jobs)))
        self.futures: dict = {}  # program name -> future

    def submit(self, spec) -> list:
        """Start compiling what ``spec`` needs (nothing twice); returns its (program name, future)s."""
        pending = []
        for program in self.objective.programs(spec):
            future = self.futures.get(program.name)
            if future is None or (future.done() and future.exception() is not None
                                  and not self.objective.failure_is_final(future.exception())):
                # New, or failed for a reason that may pass (a full disk, say): compiled (again).
                future = self.futures[program.name] = self.pool.submit(self.objective.compile, program)
            pending.append((program.name, future))
        return pending

    @staticmethod
    def ready(pending) -> bool:
        return all(future.done() for _, future in pending)

    @staticmethod
    def failure(pending) -> str | None:
        """Why the first program of ``pending`` that failed did (waiting for them); None if none did."""
        for name, future in pending:
            error = future.exception()
            if error is not None:
                return f"compile {name}: {type(error).__name__}: {first_lines(error)}"
        return None

    def close(self) -> None:
        """Stop: programs not yet started are dropped, those compiling are waited for."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def first_lines(exc: BaseException, lines: int = 6) -> str:
    return "\n".join(str(exc).strip().splitlines()[:lines])
