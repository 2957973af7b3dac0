"""What the search asks of an objective, whichever measures it (the GPU, or a cost model)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Measurement:
    """One candidate on one bucket: median µs (CUDA events, cold L2, for the GPU objective), the
    share of the copy bandwidth measured in the same run, and anything else worth keeping."""

    us: float
    bandwidth_pct: float | None = None
    detail: dict = field(default_factory=dict)


class TrialFailed(Exception):
    """A candidate that did not compile, launch or match the reference: a failed trial, with the
    reason recorded, never a crash of the run and never a winner."""


class ContextLost(TrialFailed):
    """A candidate left the GPU unusable (an illegal address, a launch failure): the process can
    measure nothing more; the run stops, and a rerun on the same storage resumes past it."""


class Objective:
    """``programs(spec)`` names what must be compiled before a candidate is measured, and
    ``compile(program)`` compiles one (on a worker thread, see `splitkv.autotune.compiling`);
    ``prepare(specs)`` compiles candidates all at once and returns the reason each one that failed
    did; ``runs(spec)`` says what the runtime launches for a candidate
    on the bucket (None: the built-in choice), so that candidates launching the same programs in
    the same plan are measured once (a tuned dense program, say, where the planner splits, runs the
    built-in split program); ``measure(spec)`` times one, planned as the runtime plans it, and
    raises `TrialFailed`; ``verify(spec)`` checks a winner once more on other inputs, returning why
    it fails (None: it passes). ``name`` says what the figures are."""

    name = "objective"
    #: Programs compiled at a time.
    jobs = 1
    #: A table entry measured again (`splitkv.autotune.remeasure`): its spec is planned as the
    #: runtime plans that entry (by the entry's ``planner`` rules); None: the tuner's candidates,
    #: planned by the current rules. An objective that plans nothing ignores it.
    served = None

    def programs(self, spec) -> list:
        """What must be compiled before ``spec`` is measured: none for an objective that compiles nothing."""
        return []

    def compile(self, program) -> None:
        """Compile one program of `programs`; raises when it fails."""

    def failure_is_final(self, error: BaseException) -> bool:
        """Whether a program that failed to compile with ``error`` would fail again (else it is
        compiled again when another candidate needs it)."""
        return True

    def prepare(self, specs) -> dict:
        """Compile the candidates' programs at once; {name: reason} of the candidates that failed."""
        from .compiling import Compiler

        with Compiler(self) as compiler:
            pending = {spec.name: compiler.submit(spec) for spec in specs}
            failures = {name: compiler.failure(p) for name, p in pending.items()}
        return {name: reason for name, reason in failures.items() if reason}

    def runs(self, spec) -> str:
        """What the candidate launches on the bucket: equal strings, equal launches. Raises
        `TrialFailed` when it cannot be planned."""
        return "built-in" if spec is None else spec.name

    def measure(self, spec, iters: int | None = None) -> Measurement:
        raise NotImplementedError

    def verify(self, spec) -> str | None:
        return None

    def close(self) -> None:
        """Let go of what the objective holds (GPU memory)."""
