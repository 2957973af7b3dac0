"""The attention variants a plan serves: several query tokens per sequence, a sliding window, a
logits soft-cap and attention sinks.

Semantics (as `splitkv.reference.attention_reference` computes them in float64):

- ``query_tokens`` T: q is ``[B, T, Hq, D]``; ``seq_lens`` counts the K/V tokens including the T
  new ones, and query token t sits at position ``seq_len - T + t`` and attends to the positions up
  to its own (causal among the new tokens).
- ``window_left`` w (-1: none): the query at position p attends to positions ``p - w .. p``.
- ``logits_soft_cap`` c (0: none): a scaled logit s = sm_scale q.k becomes ``c tanh(s / c)``
  before the softmax.
- ``sinks``: run() takes a float32 ``[Hq]`` array of logits, each joining its query head's softmax
  denominator (``exp(sink)``) once; the log-sum-exp returned stays the tokens' own.

Each is a compile-time choice of the programs (`KernelSpec.with_variant`) with run-time values in
their argument, so plain attention compiles and pays none of them. This module checks the values
and says what the planner sees: with a window, only the tokens of the window.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .choices import MAX_QUERY_TOKENS
from .spec import KernelSpec

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """A plan's attention variant, checked (`check_variant`)."""

    query_tokens: int = 1
    window_left: int = -1
    logits_soft_cap: float = 0.0
    sinks: bool = False

    @property
    def compiled(self) -> tuple:
        """The `KernelSpec.with_variant` arguments: what the programs compile in."""
        return (self.query_tokens, self.window_left >= 0, self.logits_soft_cap > 0, self.sinks)

    @property
    def is_plain(self) -> bool:
        return self.compiled == PLAIN.compiled

    @property
    def soft_cap_log2(self) -> float:
        """The cap in the programs' base-2 units of a score (0: none)."""
        return self.logits_soft_cap * _LOG2E

    def of(self, spec: KernelSpec) -> KernelSpec:
        """``spec`` with this variant compiled in (``spec`` itself where it has it)."""
        return spec if spec.compiled_variant == self.compiled else spec.with_variant(*self.compiled)

    def check_plan(self, lengths: np.ndarray, warp_heads) -> None:
        """ValueError for what a plan of this variant cannot serve: lengths shorter than the query
        tokens they count (host lengths; device ones are the caller's to keep), a warp per K/V head
        with several query tokens."""
        tokens = self.query_tokens
        if tokens > 1 and int(lengths.min(initial=tokens)) < tokens:
            i = int(np.argmax(lengths < tokens))
            raise ValueError(f"seq_lens: every length counts the {tokens} new query tokens, so is at least "
                             f"{tokens}; got seq_lens[{i}] = {int(lengths[i])}")
        if tokens > 1 and warp_heads:
            raise ValueError("warp_heads: a warp per K/V head serves one query token per sequence")

    def window_begin(self, lengths: np.ndarray, align: int) -> np.ndarray:
        """Each length's first token of the window (0 without one), rounded down to ``align``, as the
        programs compute it (merge.cuh: window_begin)."""
        if self.window_left < 0:
            return np.zeros_like(lengths)
        first = np.maximum(lengths - self.query_tokens - self.window_left, 0)
        return first - first % align

    def planned_lengths(self, lengths: np.ndarray, align: int) -> np.ndarray:
        """The tokens of each sequence the programs stream: the whole length, or with a window the
        tokens from the window's (``align``-rounded) first token on. The planner splits these."""
        if self.window_left < 0:
            return lengths
        return lengths - self.window_begin(lengths, align)


PLAIN = AttentionVariant()


def plan_variant(query_tokens=1, window_left=-1, logits_soft_cap=0.0, sinks=False) -> AttentionVariant:
    """`check_variant`, with plain attention's defaults answered at once (plan()'s common case)."""
    if query_tokens == 1 and window_left == -1 and logits_soft_cap == 0.0 and sinks is False:
        return PLAIN
    return check_variant(query_tokens, window_left, logits_soft_cap, sinks)


def check_variant(query_tokens, window_left, logits_soft_cap, sinks) -> AttentionVariant:
    """The variant of plan()'s arguments; TypeError / ValueError naming a bad one."""
    for name, value in (("query_tokens", query_tokens), ("window_left", window_left)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")
    if not 1 <= query_tokens <= MAX_QUERY_TOKENS:
        raise ValueError(f"query_tokens: expected 1 to {MAX_QUERY_TOKENS} query tokens per sequence, got {query_tokens!r}")
    if window_left < -1 or window_left >= 2**31 - 1:
        raise ValueError(f"window_left: expected -1 (no window) or a count of 0 or more tokens, got {window_left!r}")
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
        raise TypeError(f"logits_soft_cap: expected a float (0: none), got {logits_soft_cap!r}")
    cap = float(logits_soft_cap)
    float32 = np.finfo(np.float32)
    if not (math.isfinite(cap) and cap >= 0) or (cap and not float(float32.tiny) <= cap * _LOG2E <= float(float32.max)):
        raise ValueError(f"logits_soft_cap: expected 0 (none) or a positive finite float32 cap, got {logits_soft_cap!r}")
    if not isinstance(sinks, (bool, np.bool_)):
        raise TypeError(f"sinks: expected True (run() takes a sinks array) or False, got {sinks!r}")
    return AttentionVariant(int(query_tokens), int(window_left), cap, bool(sinks))
