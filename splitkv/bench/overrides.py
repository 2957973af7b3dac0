"""``--specs`` overrides: KernelSpec fields replaced in splitkv's built-in CTA shape, each timed as
one more splitkv implementation beside the planner's own choice.

Pure: `splitkv.spec` and `splitkv.heuristics` only, tested on CPU.
"""

from __future__ import annotations

import dataclasses

from ..spec import KernelSpec
from .shapes import Shape

#: Filled from the shape under test; an override may not set them.
SHAPE_FIELDS = ("head_dim", "group_size", "q_dtype", "kv_dtype")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_spec_override(text: str) -> dict:
    """'warps=8,tile_tokens=16,stages=2' -> {'warps': 8, 'tile_tokens': 16, 'stages': 2}.

    Values are converted to the KernelSpec field's type; unknown fields, fields that come from the
    shape and malformed pairs raise ValueError.
    """
    fields = {f.name: f for f in dataclasses.fields(KernelSpec)}
    out: dict = {}
    for pair in str(text).split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise ValueError(f"spec {text!r}: expected field=value pairs separated by commas, got {pair!r}")
        if key not in fields:
            raise ValueError(f"spec {text!r}: unknown KernelSpec field {key!r} (known: {sorted(fields)})")
        if key in SHAPE_FIELDS:
            raise ValueError(f"spec {text!r}: {key} comes from the shape and cannot be overridden")
        if key in out:
            raise ValueError(f"spec {text!r}: {key} given twice")
        annotation = fields[key].type
        kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        if kind == "int":
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"spec {text!r}: {key} must be an integer, got {raw!r}") from None
        elif kind == "bool":
            if raw.lower() in _TRUE:
                value = True
            elif raw.lower() in _FALSE:
                value = False
            else:
                raise ValueError(f"spec {text!r}: {key} must be true or false, got {raw!r}")
        else:
            value = raw
        out[key] = value
    if not out:
        raise ValueError(f"spec {text!r}: no field=value pairs")
    return out


def spec_label(overrides: dict) -> str:
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())


def builtin_spec(shape: Shape, arch: str) -> KernelSpec:
    """splitkv's own CTA shape for this shape when it can be asked, else KernelSpec's defaults.

    Overrides are applied on top of it, so that ``warps=8`` changes the warps of what splitkv
    would have run and nothing else.
    """
    key = dict(head_dim=shape.head_dim, group_size=shape.group_size, q_dtype="bf16", kv_dtype=shape.kv_dtype)
    try:
        from ..heuristics import default_spec
    except ImportError:
        return KernelSpec(arch=arch, **key)
    for tokens in ({"query_tokens": shape.query_tokens} if shape.query_tokens > 1 else {}, {}):
        try:  # the shape of that many query tokens where the heuristic has one (not before it did)
            return default_spec(arch=arch, **key, **tokens)
        except (AttributeError, TypeError, ValueError):
            continue
    return KernelSpec(arch=arch, **key)


def spec_for_shape(overrides: dict, shape: Shape, arch: str, base: KernelSpec | None = None) -> KernelSpec:
    """The KernelSpec an override means for one shape: ``base`` (KernelSpec's defaults with the
    shape's head_dim, group and dtypes when None) with the overridden fields replaced. ``variant``
    is left out: it goes to plan(), which builds each program's spec from this one (a dense
    program, say, without the split program's cluster). Raises ValueError when the result is
    invalid."""
    overrides = {key: value for key, value in overrides.items() if key != "variant"}
    if base is None:
        fields = dict(arch=arch, head_dim=shape.head_dim, group_size=shape.group_size,
                      q_dtype="bf16", kv_dtype=shape.kv_dtype)
        return KernelSpec(**{**fields, **overrides})
    return base.replace(**overrides)
