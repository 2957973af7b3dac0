"""Another copy of the project, imported beside this one so that both are timed in one process.

An A/B comparison is sound only when both sides see the same GPU state, the same inputs and the
same protocol, in alternating order: the two trees have to live in one process. Two ``splitkv``
packages can, under two names, because every import inside the package is relative (``from .spec
import ...``): loaded under a unique name (``splitkv_checkout_1``), a tree's modules resolve to
its own files. What a tree looks up by the name ``splitkv`` at run time (its Jinja templates, its
CUDA headers: ``importlib.resources.files("splitkv")``) resolves through ``sys.modules["splitkv"]``,
so `Checkout.active` points that entry at the checkout, and hides this tree's ``splitkv.*``
submodules, while the checkout sets up (builds, plans, compiles, captures). A submodule that the
checkout imports by absolute name in that time shows up as a new ``splitkv.*`` entry: it would have
mixed the two trees, and `CheckoutError` says so instead of timing a hybrid. The kernel cache is
keyed by the rendered source, so the two trees share a cubin only where their programs are the
same text.

A subprocess per tree would avoid the question, but could not alternate the trees call by call on
one stream, nor check both against one set of inputs; and a tree that is still being set up in
one process while the other times would disturb the figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "splitkv"
_counter = itertools.count(1)


class CheckoutError(RuntimeError):
    """The directory is not a checkout that can be imported beside this one."""


def package_dir(root: Path) -> Path:
    """``root/splitkv``, the package of a checkout (or ``root`` itself when it is the package)."""
    root = Path(root)
    for candidate in (root / PACKAGE, root):
        if (candidate / "__init__.py").is_file() and (candidate / "runtime.py").is_file():
            return candidate.resolve()
    raise CheckoutError(f"{root}: no splitkv package (expected {root / PACKAGE / '__init__.py'})")


def _own_modules() -> set:
    return {name for name in sys.modules if name.startswith(PACKAGE + ".")}


class Checkout:
    """A checkout's splitkv package, imported under ``alias``; ``module`` is its top-level
    package (``module.DecodeAttention``, ``module.QuantizedKV``...)."""

    def __init__(self, root: Path, alias: str | None = None, commit: str | None = None):
        self.package = package_dir(root)
        self.root = self.package.parent
        self.alias = alias or f"{PACKAGE}_checkout_{next(_counter)}"
        if self.alias in sys.modules:
            raise CheckoutError(f"{self.alias}: a module of that name is already imported")
        found_commit, self.dirty = checkout_commit(self.root)
        self.commit = commit or found_commit
        spec = importlib.util.spec_from_file_location(self.alias, self.package / "__init__.py",
                                                      submodule_search_locations=[str(self.package)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.alias] = module
        self.module = module
        try:
            with self.active():
                spec.loader.exec_module(module)
        except BaseException:
            for name in [n for n in sys.modules if n == self.alias or n.startswith(self.alias + ".")]:
                del sys.modules[name]
            raise

    @contextlib.contextmanager
    def active(self):
        """``sys.modules['splitkv']`` is this checkout, and this tree's ``splitkv.*`` submodules
        are out of sight, until the block ends; raises CheckoutError when the block imported a
        ``splitkv.*`` module by absolute name (both trees would have run in it)."""
        saved_top = sys.modules.get(PACKAGE)
        hidden = {name: sys.modules.pop(name) for name in _own_modules()}
        sys.modules[PACKAGE] = self.module
        try:
            yield self.module
        finally:
            leaked = sorted(_own_modules())
            for name in leaked:
                del sys.modules[name]
            sys.modules.update(hidden)
            if saved_top is not None:
                sys.modules[PACKAGE] = saved_top
            else:
                sys.modules.pop(PACKAGE, None)
        if leaked:
            raise CheckoutError(f"{self.root}: imports {', '.join(leaked)} by absolute name, which would "
                                "mix the two trees in one process; time it in a process of its own")

    def describe(self) -> dict:
        """What a result records of this side: its commit, whether its tree had changes, the
        directory's last component (no path of the machine)."""
        return {"commit": self.commit, "dirty": self.dirty, "directory": self.root.name, "module": self.alias}


def checkout_commit(root: Path) -> tuple[str, bool | None]:
    """(short commit, tree has uncommitted changes) of the checkout at ``root``: git's answer
    where ``root`` is the top of a work tree of its own (a ``git worktree``); else the first word
    of a ``COMMIT`` file there (what ``git archive`` leaves out, written beside it); else
    ('unknown', None). A directory inside another repository is not taken for that repository's
    commit."""
    root = Path(root).resolve()
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                  text=True, timeout=10)
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10)
            if head.returncode == 0 and head.stdout.strip():
                return head.stdout.strip(), bool(status.returncode == 0 and status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    marker = root / "COMMIT"
    if marker.is_file():
        words = marker.read_text(encoding="utf-8", errors="replace").split()
        if words and re.fullmatch(r"[0-9a-fA-F]{4,40}", words[0]):
            return words[0][:12].lower(), None
    return "unknown", None


def adopt_cache(module, x):
    """``x`` as ``module``'s runtime accepts it: a quantized cache made by another tree becomes
    ``module.QuantizedKV`` over the very same arrays (each tree checks for its own class); any
    other input is returned as it is."""
    own = getattr(module, "QuantizedKV", None)
    if type(x).__name__ != "QuantizedKV" or own is None or isinstance(x, own):
        return x
    return own(x.kv_dtype, x.values, x.block_scales, x.scale)
