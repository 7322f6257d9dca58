"""`jaxshard.shard_map`: `jax.shard_map` with its specs read from the function's
annotations, whose body may make both kinds of checks: each annotated block is
checked as the global array it is part of, and value checks come out of the body as
an extra output that `checked` reads."""

import functools as ft
import typing
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations.logical import active_rules, using
from .._annotations.spec import format_spec, padded
from .._config import normalise
from .._errors import AnnotationError, expect, ShardingError
from .._sharding.array_types import partition_spec
from .._sharding.decorator import checked_by_jaxshard
from .._sharding.layout import explicit_mismatch, is_array_like, is_explicit
from .._sharding.signature import (
    _array_annotations,
    _input_spec,
    _leaves,
    _listing,
    _name,
    _positional,
    _shardings,
    signature,
)
from .frames import Findings, shard_map_checks


def shard_map(
    fn: Callable | None = None, mesh: Any = None, *, rules: Any = None, **kwargs
) -> Callable:
    """`jax.shard_map`, with `in_specs` and `out_specs` read from `fn`'s annotations.

    The function is wrapped in `jaxshard.jaxtyped` (with beartype), so inside it each
    annotated block is checked as the core annotations describe: shapes against the
    global array, and which mesh axes it varies over.

    **Arguments:**

    - `fn`: the per-shard function; its positional parameters and its return value
        carry partition specs. Leave it out to use `jaxshard.shard_map(mesh=...)` as a
        decorator.
    - `mesh`: as for `jax.shard_map`; by default the mesh in context.
    - `rules`: the axis rules for logical annotations, as `jaxshard.axis_rules`
        takes them; by default those in force at each call (the specs are read again
        when they change).
    - `**kwargs`: passed on to `jax.shard_map` (`axis_names`, `check_vma`, and
        `in_specs`/`out_specs` to override the annotations). With `axis_names`
        (partly manual), the specs read from the annotations, which describe the
        global array, are given to `jax.shard_map` over the manual axes alone.

    **Returns:**

    The function `jax.shard_map` returns.

    !!! Example

        ```python
        @jaxshard.shard_map(mesh=mesh)
        def local_sum(x: Float[Array, "batch d", P("dp")]) -> Float[Array, "d", P()]:
            return jax.lax.psum(x.sum(0), "dp")
        ```
    """
    expect(fn is None or callable(fn), "shard_map", "fn", "a function", fn)
    if fn is None:
        return ft.partial(shard_map, mesh=mesh, rules=rules, **kwargs)
    what = f"jaxshard.shard_map({_name(fn)})"
    if rules is not None or _is_logical(fn):
        # Logical specs are read at each call, under the rules then in force.
        made: dict = {}
        table = None if rules is None else normalise(rules)

        @ft.wraps(fn)
        def logical(*args):
            with using(table):
                key = active_rules()
                if key not in made:
                    made[key] = _shard_map(fn, mesh, what, dict(kwargs))
                return made[key](*args)

        return logical
    return _shard_map(fn, mesh, what, kwargs)


def _is_logical(fn: Callable) -> bool:
    _, hints = signature(fn)
    return any(
        hasattr(a, "explain") for h in hints.values() for a in _array_annotations(h)
    )


def _shard_map(fn: Callable, mesh: Any, what: str, kwargs: dict) -> Callable:
    sig, _ = signature(fn)
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            raise AnnotationError(
                f"{what}: parameter {p.name!r} is keyword-only, but jax.shard_map "
                "passes arguments by position."
            )
    annotated = "in_specs" not in kwargs  # the in_specs are the annotations'
    read = [side for side in ("in_specs", "out_specs") if side not in kwargs]
    if read:
        # A block is laid out whole along an unconstrained dimension.
        ins, out = _shardings(fn, _input_spec)
        params = _positional(sig, what)
        missing = [p.name for p, s in zip(params, ins) if _has_none(s)]
        if "in_specs" not in kwargs:
            if missing:
                raise AnnotationError(
                    f"{what}: {_listing('parameter', missing)} no partition spec in "
                    "the annotation, so there is no in_spec for it. Add one to the "
                    "annotation (`P()` for a replicated value) or pass `in_specs=`."
                )
            kwargs["in_specs"] = ins
        if "out_specs" not in kwargs:
            if _has_none(out):
                raise AnnotationError(
                    f"{what}: the return annotation has no partition spec (or only "
                    "for some leaves), so there is no out_spec. Add one (`P()` for a "
                    "replicated value) or pass `out_specs=`."
                )
            kwargs["out_specs"] = out
        if "axis_names" in kwargs:
            # Partly manual: the annotations describe the global array, over every
            # axis; jax.shard_map's specs name the manual axes alone.
            for side in read:
                kwargs[side] = _over(set(kwargs["axis_names"]), kwargs[side])
    body = checked_by_jaxshard(fn)

    def body_with_checks(*args):
        # Value checks inside the body come out as an extra, replicated output,
        # whose tree structure holds the frame (so jit's cache gives it back).
        with shard_map_checks() as frame:
            out = body(*args)
        return out, Findings(frame, frame.packed())

    kwargs["out_specs"] = (kwargs["out_specs"], PartitionSpec())
    mapped = jax.shard_map(body_with_checks, mesh=mesh, **kwargs)
    # JAX runs a shard_map op by op outside jit (eagerly, or under `grad` or `vmap`
    # there), and then refuses the Refs its body's checks make: it is always jitted
    # (inside an outer jit, a nested jit is inlined into it).
    compiled = jax.jit(mapped)

    _, hints = signature(fn)
    arrays = [
        (i, p.name, _sharded(hints[p.name]))
        for i, p in enumerate(_positional(sig, what))
        if annotated and partition_spec(hints.get(p.name)) is not None
    ]

    @ft.wraps(fn)
    def wrapper(*args):
        args = _laid_out(what, arrays, args)
        out, found = compiled(*args)
        found.frame.forward(found.packed)
        return out

    return wrapper


def _laid_out(what: str, arrays: list[tuple[int, str, Any]], args: tuple) -> tuple:
    """`args`, each as its in_spec (its annotation's) lays it out. On Explicit axes
    `jax.shard_map` takes an input only in its in_spec's very layout: one laid out
    otherwise is a `ShardingError` naming the parameter (not JAX's own error), and
    one in an equivalent layout (`P('dp')` for `P()`, `dp` of size 1) gets the
    in_spec's."""
    args = list(args)
    for i, name, annotation in arrays:
        if i >= len(args):
            break
        arg = args[i]
        if not is_array_like(arg):  # another arm of a union (a quantized pair, say)
            raise AnnotationError(
                f"{what}: parameter {name!r} is a {type(arg).__name__}, but its "
                f"annotation states a partition spec for an array only "
                f"({format_spec(annotation.spec)}), so there is no in_spec for "
                f"what it holds. Pass `in_specs=` with a spec for each of its "
                "arrays (a tree of the same structure, as jax.shard_map takes it)."
            )
        spec = _input_spec(annotation.spec)  # an unconstrained dimension is whole
        reason = explicit_mismatch(annotation, arg, spec)
        if reason:
            raise ShardingError(
                f"{what}, parameter {name!r}: {reason} On Explicit mesh axes, "
                "jax.shard_map takes its inputs laid out as its in_specs (here the "
                "annotations, unconstrained dimensions whole) say: reshard it first, "
                f"e.g. `jax.sharding.reshard(x, {format_spec(spec)})`."
            )
        if is_explicit(arg) and jax.typeof(arg).sharding.spec != padded(
            spec, len(arg.shape)
        ):
            concrete = not isinstance(arg, jax.core.Tracer)
            mesh = (arg.sharding if concrete else jax.typeof(arg).sharding).mesh
            args[i] = jax.sharding.reshard(arg, NamedSharding(mesh, spec))
    return tuple(args)


def _sharded(annotation: Any) -> Any:
    """The member of a union annotation that states the spec (or the annotation)."""
    for member in typing.get_args(annotation) or (annotation,):
        if partition_spec(member) is not None:
            return member
    return annotation


def _over(manual: set, specs: Any) -> Any:
    """`specs` (a tree of `PartitionSpec`s) with every axis not in `manual` left
    out: `P(("dp", "fsdp"), "tp")` over `{"dp"}` is `P("dp", None)`."""

    def entry(e: Any) -> Any:
        names = tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in manual)
        return None if not names else names[0] if len(names) == 1 else names

    def spec(s: Any) -> Any:
        return s if s is None else PartitionSpec(*(entry(e) for e in s))

    return jax.tree.map(
        spec, specs, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
    )


def _has_none(tree: Any) -> bool:
    return any(leaf is None for leaf in _leaves(tree))
