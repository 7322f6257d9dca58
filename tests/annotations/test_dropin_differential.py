"""Differential tests: each case is run with `jaxtyping.jaxtyped` and jaxtyping's
annotations, and with `jaxshard.jaxtyped` and jaxshard's (and, where the values are
jax arrays, jaxshard's annotations with the trivial spec `P()`), under beartype and
typeguard; the verdicts and exception types must agree."""

import dataclasses
import typing
from typing import NamedTuple

import jax.numpy as jnp
import jaxtyping
import pytest
from jax import Array

import jaxshard


_LIBS = (jaxtyping, jaxshard)


def _outcome(thunk) -> tuple:
    """("ok",) or (exception kind, message); a `ShardingError` counts as the
    `TypeCheckError` it is."""
    try:
        thunk()
    except jaxtyping.TypeCheckError as e:
        return (jaxtyping.TypeCheckError, str(e))
    except Exception as e:
        return (type(e), str(e))
    return ("ok",)


def _function(lib, typechecker, annotations: list, returned: typing.Any = None):
    """`def f(a0: A0, a1: A1, ...) -> returned: return a0`, decorated by `lib`."""
    params = ", ".join(f"a{i}: A{i}" for i in range(len(annotations)))
    namespace = {f"A{i}": a for i, a in enumerate(annotations)}
    namespace["R"] = returned
    exec(f"def f({params}) -> R:\n    return a0", namespace)
    return lib.jaxtyped(typechecker=typechecker)(namespace["f"])


def _verdicts(make, calls, typechecker) -> list:
    """For `make(lib, typechecker)` (a callable) and each argument tuple in `calls`:
    jaxtyping's outcome kind and jaxshard's."""
    out = []
    for args in calls:
        pair = [
            _outcome(lambda lib=lib: make(lib, typechecker)(*args))[0] for lib in _LIBS
        ]
        out.append(tuple(pair))
    return out


def _agree(make, calls, typechecker, expected: list | None = None) -> None:
    verdicts = _verdicts(make, calls, typechecker)
    for args, (theirs, ours) in zip(calls, verdicts):
        assert theirs == ours, (args, theirs, ours)
    if expected is not None:
        assert [v[0] == "ok" for v in verdicts] == expected


z = jnp.zeros


# --- a dimension bound twice: only where jaxtyping binds it ------------------------


class _Pair(NamedTuple):
    a: jaxtyping.Float[Array, "b"]


@dataclasses.dataclass
class _Box:
    a: jaxtyping.Float[Array, "b"]


@pytest.mark.parametrize("holder", [_Pair, _Box])
def test_fields_of_an_argument_bind_the_calls_dimensions_as_the_typechecker_does(
    holder, typechecker
):
    """beartype checks a NamedTuple or dataclass argument by its class, typeguard
    looks into a NamedTuple's fields (with the call's dimensions) but not a
    dataclass's. When `y` fails for its dtype, jaxshard says `b` is bound twice only
    where jaxtyping bound it from `t.a`: it said so under beartype too ("dimension
    'b' is 3 from parameter 't.a'"), where the same call with a float `y` passes."""

    def make(lib, typechecker):
        def f(t: holder, y: lib.Float[Array, "b"]):
            return t

        return lib.jaxtyped(typechecker=typechecker)(f)

    looked_into = holder is _Pair and typechecker.__module__.startswith("typeguard")
    calls = [(holder(z(3)), z(3)), (holder(z(3)), z(4)), (holder(z(3)), z(4, int))]
    _agree(make, calls, typechecker, expected=[True, not looked_into, False])
    with pytest.raises(jaxtyping.TypeCheckError) as e:
        make(jaxshard, typechecker)(holder(z(3)), z(4, int))
    first = str(e.value).splitlines()[0]
    claimed = "dimension 'b' is 3 from parameter 't.a' (shape (3,)) but 4 in"
    assert (claimed in first) is looked_into, first
    if not looked_into:
        assert first.startswith("Type-check error whilst checking the parameters")
