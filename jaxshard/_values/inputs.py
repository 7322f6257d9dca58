"""`checked(fn, inputs_finite=...)`: `fn`'s floating-point inputs checked for NaN
and infinity as the call starts, so that a report can name a bad input (a batch
holding NaN) as the origin of what failed after it, not list a NaN loss and its
gradients as so many failures.

The checks are `check_finite`'s, made in the call's own program (a jitted `fn`) or
in a small jitted program before `fn` runs (any other): no extra host sync. Their
sites carry the parameter's name (`sites.checking_input`), and `CheckError` lists
them first.
"""

import functools as ft
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import did_you_mean, expect
from .._jax_internals import jit_parameters
from .checks import _check_many, _NON_FINITE
from .sites import checking_input


def with_input_checks(fn: Callable, inputs_finite: Any, name: str) -> Callable:
    """`fn` (the `checked` function `name`), checking first that the inputs
    `inputs_finite` selects are finite: a function of the same kind (a `jax.jit`
    function stays one, with its static and donated arguments and shardings)."""
    expect(
        isinstance(inputs_finite, bool)
        or (
            isinstance(inputs_finite, Sequence)
            and not isinstance(inputs_finite, str)
            and all(isinstance(n, str) for n in inputs_finite)
        ),
        "checked",
        "inputs_finite",
        "True, False, or a list of parameter names",
        inputs_finite,
    )
    if inputs_finite is False:
        return fn
    params = jit_parameters(fn)
    target = fn if params is None else params["fun"]
    sig = inspect.signature(target)
    names = _selected(sig, inputs_finite, name)
    where = _definition(target)
    if params is not None:

        @ft.wraps(target)
        def program(*args, **kwargs):
            _check_inputs(_inputs(sig, names, args, kwargs), where)
            return target(*args, **kwargs)

        kept = {k: v for k, v in params.items() if k != "fun"}
        with warnings.catch_warnings():
            # `device` and `backend`, deprecated: `jax.jit(fn, ...)` warned already.
            warnings.simplefilter("ignore", DeprecationWarning)
            return jax.jit(program, **kept)

    check = jax.jit(ft.partial(_check_inputs, where=where))

    @ft.wraps(fn)
    def checking(*args, **kwargs):
        inputs = _inputs(sig, names, args, kwargs)
        if inputs:
            check(inputs)
        return fn(*args, **kwargs)

    return checking


def _selected(sig: inspect.Signature, inputs_finite: Any, name: str) -> list[str]:
    parameters = [
        p.name
        for p in sig.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if inputs_finite is True:
        return parameters
    unknown = [n for n in inputs_finite if n not in parameters]
    if unknown:
        raise ValueError(
            f"jaxshard.checked({name}): inputs_finite names "
            f"{', '.join(map(repr, unknown))}, which {name} does not take; its "
            f"parameters are {', '.join(map(repr, parameters)) or 'none'}."
            + did_you_mean(unknown, parameters)
        )
    return list(inputs_finite)


def _definition(fn: Callable) -> tuple[str, int]:
    """Where the input checks are said to be: the function's `def` (its first
    decorator's line)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return "<unknown>", 0
    return code.co_filename, code.co_firstlineno


def _is_float_array(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, jax.core.Tracer))
        or (hasattr(x, "__array__") and hasattr(x, "dtype") and hasattr(x, "shape"))
    ) and jnp.issubdtype(x.dtype, jnp.inexact)


def _inputs(sig: inspect.Signature, names: list[str], args, kwargs) -> dict:
    """Parameter name -> its value's floating-point arrays (other leaves, static
    arguments among them, dropped), for the selected parameters that have any."""
    try:
        arguments = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return {}  # the call itself will say what is wrong
    out = {}
    for name in names:
        if name in arguments:
            tree = jax.tree.map(
                lambda x: x if _is_float_array(x) else None, arguments[name]
            )
            if jax.tree.leaves(tree):
                out[name] = tree
    return out


def _check_inputs(inputs: dict, where: tuple[str, int]) -> None:
    """`check_finite` of each input, its sites having the parameter as origin."""
    for name, tree in inputs.items():
        entries = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            at = name + jax.tree_util.keystr(path)
            message = f"input {at} holds NaN or infinity (first: {{value}})"
            kinds = _NON_FINITE if jnp.isrealobj(leaf) else None
            entries.append(
                (
                    None,
                    message,
                    {"value": leaf},
                    jnp.shape(leaf),
                    jnp.isfinite,
                    leaf,
                    kinds,
                )
            )
        with checking_input(name):
            _check_many(entries, *where)
