"""CPU tests of importing another checkout beside this tree (`splitkv.bench.checkout`): fake
packages for the rules, and a copy of this very tree for what the benchmark relies on (its
templates and headers come from the copy, not from this tree)."""

import importlib
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import splitkv
from splitkv.bench import checkout
from splitkv.bench.checkout import Checkout, CheckoutError

ROOT = Path(splitkv.__file__).resolve().parent


def fake_tree(tmp_path, name, init="", files=None):
    """tmp_path/name/splitkv/ with an __init__ (``init``), a runtime.py and ``files``."""
    package = tmp_path / name / "splitkv"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(init))
    (package / "runtime.py").write_text("WHERE = __name__\n")
    for rel, text in (files or {}).items():
        (package / rel).write_text(textwrap.dedent(text))
    return package.parent


def _own_modules():
    return {k: v for k, v in sys.modules.items() if k == "splitkv" or k.startswith("splitkv.")}


RESOURCE_INIT = """
    import importlib.resources
    from .runtime import WHERE

    def data():
        # looked up by the package's name, as splitkv's templates are
        return (importlib.resources.files("splitkv") / "data.txt").read_text()
"""


def test_a_checkout_loads_under_its_own_name_and_reads_its_own_files(tmp_path):
    before = _own_modules()
    root = fake_tree(tmp_path, "old", RESOURCE_INIT, {"data.txt": "old data"})
    (root / "COMMIT").write_text("684c77a\n")
    old = Checkout(root)
    assert old.module.WHERE == f"{old.alias}.runtime" and old.alias.startswith("splitkv_checkout_")
    assert old.commit == "684c77a" and old.describe() == {"commit": "684c77a", "dirty": None, "directory": "old",
                                                           "module": old.alias}
    with old.active() as module:
        assert module is old.module and sys.modules["splitkv"] is old.module
        assert module.data() == "old data"
    assert _own_modules() == before  # this tree's modules are back, the same objects


def test_two_copies_of_one_tree_are_two_modules(tmp_path):
    root = fake_tree(tmp_path, "same", RESOURCE_INIT, {"data.txt": "x"})
    a, b = Checkout(root, commit="abc1234"), Checkout(root, commit="abc1234")
    assert a.alias != b.alias and a.module is not b.module and a.module.runtime is not b.module.runtime
    with pytest.raises(CheckoutError, match="already imported"):
        Checkout(root, alias=a.alias)


def test_an_absolute_self_import_at_load_is_refused_and_cleaned_up(tmp_path):
    before = _own_modules()
    root = fake_tree(tmp_path, "absolute", "import splitkv.runtime\n")
    with pytest.raises(CheckoutError, match="splitkv.runtime by absolute name"):
        Checkout(root, alias="splitkv_absolute_probe")
    assert "splitkv_absolute_probe" not in sys.modules and _own_modules() == before


def test_a_lazy_absolute_import_during_setup_is_refused(tmp_path):
    before = _own_modules()
    root = fake_tree(tmp_path, "lazy", "def late():\n    import splitkv.runtime\n    return splitkv.runtime.WHERE\n")
    lazy = Checkout(root)
    with pytest.raises(CheckoutError, match="by absolute name"):
        with lazy.active() as module:
            # Without the check this would have run the checkout's runtime as this tree's.
            assert module.late() == "splitkv.runtime"
    assert _own_modules() == before


def test_package_dir_accepts_the_tree_or_the_package(tmp_path):
    root = fake_tree(tmp_path, "t")
    assert checkout.package_dir(root) == (root / "splitkv").resolve()
    assert checkout.package_dir(root / "splitkv") == (root / "splitkv").resolve()
    with pytest.raises(CheckoutError, match="no splitkv package"):
        checkout.package_dir(tmp_path)


def test_commit_of_a_directory_inside_another_repository_is_not_that_repository(tmp_path):
    # The package folder of this checkout sits inside its repository but is not its top.
    assert checkout.checkout_commit(ROOT) == ("unknown", None)
    (tmp_path / "COMMIT").write_text("not-a-hash\n")
    assert checkout.checkout_commit(tmp_path) == ("unknown", None)
    (tmp_path / "COMMIT").write_text("684C77A1234 from git archive\n")
    assert checkout.checkout_commit(tmp_path) == ("684c77a1234", None)


def test_a_quantized_cache_is_rewrapped_in_the_checkouts_own_class():
    class Mine:
        def __init__(self, kv_dtype, values, block_scales, scale):
            self.kv_dtype, self.values, self.block_scales, self.scale = kv_dtype, values, block_scales, scale

    class Package:
        QuantizedKV = Mine

    theirs = splitkv.QuantizedKV("fp8_e4m3", "values", None, "scale")
    adopted = checkout.adopt_cache(Package, theirs)
    assert isinstance(adopted, Mine) and (adopted.kv_dtype, adopted.values, adopted.scale) == ("fp8_e4m3", "values", "scale")
    assert checkout.adopt_cache(Package, adopted) is adopted
    assert checkout.adopt_cache(Package, "a bf16 tensor") == "a bf16 tensor"
    assert checkout.adopt_cache(splitkv, theirs) is theirs


def test_a_copy_of_this_tree_renders_from_its_own_templates(tmp_path):
    # What the in-process A/B stands on: a checkout's programs are rendered from the checkout's
    # templates and headers, even though the renderer finds them by the name "splitkv".
    pytest.importorskip("jinja2")
    copy = tmp_path / "copy" / "splitkv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "tuned_configs", "*.lock"))
    (copy / "tuned_configs").mkdir()
    marker = "// rendered from the checkout's own template"
    (copy / "templates" / "decode.cu.j2").write_text((copy / "templates" / "decode.cu.j2").read_text() + marker + "\n")
    (copy / "templates" / "primitives.cuh").write_text((copy / "templates" / "primitives.cuh").read_text() + marker + "\n")
    from splitkv.heuristics import default_spec

    own_render = importlib.import_module("splitkv.codegen.render")

    before = _own_modules()
    other = Checkout(copy.parent, commit="0000000")
    with other.active():
        # As the runtime imports them: relative to its own package.
        render = importlib.import_module(f"{other.alias}.codegen.render")
        heuristics = importlib.import_module(f"{other.alias}.heuristics")
        from_copy = render.render(heuristics.default_spec("sm_90", 128, 4))
        headers = render.helper_headers()
    assert render.__file__.startswith(str(tmp_path))
    assert marker in from_copy and marker in headers["primitives.cuh"]
    own = own_render.render(default_spec("sm_90", 128, 4))
    assert marker not in own and marker not in own_render.helper_headers()["primitives.cuh"]
    assert from_copy == own + marker + "\n"  # the same program otherwise
    assert _own_modules() == before
