"""`jaxshard.jaxtyped` as a drop-in for `jaxtyping.jaxtyped`."""

import dataclasses
import sys
import typing

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


def test_checks_without_a_typechecker():
    """jaxtyping alone checks nothing here (and warns); jaxshard uses beartype."""

    @jaxshard.jaxtyped
    def f(x: Float[Array, "n"]) -> Float[Array, "n"]:
        return x

    @jaxshard.jaxtyped()
    def g(x: Float[Array, "n"]):
        return x

    f(jnp.ones(3))
    for fn in (f, g):
        with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
            fn(jnp.ones((3, 2)))


def test_typechecker_none_is_jaxtypings():
    """`typechecker=None`: only the body's own `isinstance` checks, as in jaxtyping."""

    @jaxshard.jaxtyped(typechecker=None)
    def f(x: Float[Array, "n"], y: Float[Array, "n"]):
        return isinstance(x, Float[Array, "n"]) and isinstance(y, Float[Array, "n"])

    assert f(jnp.ones(3), jnp.ones(3))
    assert not f(jnp.ones(2), jnp.ones(3))
    assert f("not checked", jnp.ones(3)) is False


def test_old_double_decorator_checks_once():
    """`@jaxtyped @beartype` (jaxtyping's old syntax) is checked by the inner beartype
    only."""

    @beartype.beartype
    def inner(x: Float[Array, "n"]):
        return x

    with pytest.warns(UserWarning, match="As of jaxtyping version 0.2.24"):
        f = jaxshard.jaxtyped(inner)
    f(jnp.ones(3))
    with pytest.raises(beartype.roar.BeartypeCallHintParamViolation):
        f(jnp.ones((3, 2)))


@pytest.mark.parametrize("where", ["function", "method"])
def test_no_type_check_above_turns_checking_off(where):
    if where == "function":

        @typing.no_type_check
        @jaxshard.jaxtyped(typechecker=beartype.beartype)
        def f(x: Float[Array, "n"]):
            return x

    else:

        class A:
            @typing.no_type_check
            @jaxshard.jaxtyped(typechecker=beartype.beartype)
            def f(self, x: Float[Array, "n"]):
                return x

        f = A().f
    f(jnp.ones((3, 2)))  # not checked
    f("not an array")


def test_no_type_check_above_an_equinox_module():
    @typing.no_type_check
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    class M(eqx.Module):
        x: Float[Array, "n"]

    M(jnp.ones((3, 2)))  # not checked

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    class N(eqx.Module):
        x: Float[Array, "n"]

    with pytest.raises(jaxtyping.TypeCheckError):
        N(jnp.ones((3, 2)))


def test_a_decorated_dataclass_is_wrapped_once():
    """Decorating an already decorated dataclass again wraps nothing more: one call
    runs the typechecker as often as with one decorator (jaxtyping's own check, which
    recognises only its own wrapper, would wrap jaxshard's again)."""

    def counting(calls):
        def typechecker(fn):
            checked = beartype.beartype(fn)

            def wrapper(*args, **kwargs):
                calls.append(1)
                return checked(*args, **kwargs)

            return wrapper

        return typechecker

    once, twice = [], []

    @jaxshard.jaxtyped(typechecker=counting(once))
    @dataclasses.dataclass
    class D1:
        x: int

    @jaxshard.jaxtyped(typechecker=counting(twice))
    @jaxshard.jaxtyped(typechecker=counting(twice))
    @dataclasses.dataclass
    class D2:
        x: int

    D1(1)
    D2(1)
    assert len(once) == len(twice) > 0
    with pytest.raises(jaxtyping.TypeCheckError):
        D2("one")


def test_refuses_what_it_cannot_decorate():
    with pytest.raises(TypeError, match="decorates a function, method or class; got 3"):
        jaxshard.jaxtyped(3)


# What jaxtyping's module `__getattr__` makes on first use.
_JAXTYPING_LAZY = ["Array", "ArrayLike", "DTypeLike", "PRNGKeyArray", "PyTree"]
_JAXTYPING_LAZY += ["PyTreeDef", "Scalar", "ScalarLike"]


def _jaxtyping_public_names() -> list[str]:
    """jaxtyping's `__all__` if it has one; else (0.3.11) the names its `__init__`
    re-exports as `import X as X`, its convention for public names, and those its
    module `__getattr__` makes."""
    import ast
    import inspect

    if hasattr(jaxtyping, "__all__"):
        return sorted(jaxtyping.__all__)
    tree = ast.parse(inspect.getsource(jaxtyping))
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    return sorted(names | set(_JAXTYPING_LAZY))


def test_every_public_jaxtyping_name_is_here():
    names = _jaxtyping_public_names()
    assert {"Float", "jaxtyped", "PyTree", "print_bindings", "Scalar"} <= set(names)
    for name in names:
        ours, theirs = getattr(jaxshard, name), getattr(jaxtyping, name)
        if name in {"jaxtyped", "config"}:
            continue  # extended: see their docstrings and tests
        dtype_class = isinstance(theirs, type) and hasattr(theirs, "dtypes")
        if dtype_class and issubclass(theirs, jaxtyping.AbstractDtype):
            assert issubclass(ours, theirs) and ours.dtypes == theirs.dtypes, name
        else:
            assert ours is theirs, name
        namespace = {}
        exec(f"from jaxshard import {name}", namespace)
        assert namespace[name] is ours
    assert set(names) - {"config"} <= set(jaxshard.__all__) | {"config"}


def test_dtype_identity_survives_pickling():
    import pickle

    import numpy as np

    ann = jaxshard.Shaped[np.ndarray, "3 4"]
    assert ann.dtype is jaxshard.Shaped
    assert issubclass(ann.dtype, jaxtyping.Shaped)
    back = pickle.loads(pickle.dumps(ann))
    assert back.dtype is jaxshard.Shaped and back.dim_str == "3 4"
    assert isinstance(np.zeros((3, 4)), back)
    assert not isinstance(np.zeros((3, 5)), back)
    assert jaxtyping.Shaped[np.ndarray, "3 4"].dtype is jaxtyping.Shaped
    union = jaxshard.Float[np.ndarray | jax.Array, "n"]
    assert {a.dtype for a in typing.get_args(union)} == {jaxshard.Float}


def test_lazy_names():
    import subprocess
    import sys

    script = (
        "import sys, jaxshard; assert 'hypothesis' not in sys.modules; "
        "s = jaxshard.strategies; assert s.arrays; "
        "assert jaxshard.Scalar is __import__('jaxtyping').Scalar; "
        "assert 'strategies' in dir(jaxshard)"
    )
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxshard.nope


def test_import_hook_with_jaxshards_names(tmp_path, monkeypatch):
    """`jaxshard.install_import_hook` checks a module's annotations, sharded ones
    included."""
    # A module name of its own: test_annotations imports another `hooked_module`.
    (tmp_path / "hooked_by_name.py").write_text(
        "import jax\n"
        "from jaxshard import Float\n"
        "def f(x: Float[jax.Array, 'n']) -> Float[jax.Array, 'n']:\n"
        "    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with jaxshard.install_import_hook("hooked_by_name", "beartype.beartype"):
        import hooked_by_name
    try:
        hooked_by_name.f(jnp.ones(3))
        with pytest.raises(jaxtyping.TypeCheckError):
            hooked_by_name.f(jnp.ones((3, 2)))
    finally:
        sys.modules.pop("hooked_by_name")


def test_ipython_extension_is_jaxtypings():
    assert jaxshard.load_ipython_extension is jaxtyping.load_ipython_extension


def test_decorating_a_jitted_function(explicit_mesh):
    import functools as ft

    from jax.sharding import NamedSharding, PartitionSpec as P

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    @ft.partial(jax.jit, static_argnums=1)
    def f(x: Float[Array, "n", P("dp")], k: int) -> Float[Array, "n", P("dp")]:
        return x * k

    x = jax.device_put(jnp.ones(8), NamedSharding(explicit_mesh, P("dp")))
    assert float(f(x, 3).sum()) == 24.0
    with pytest.raises(jaxshard.ShardingError, match="parameter 'x'"):
        f(jax.device_put(jnp.ones(8), NamedSharding(explicit_mesh, P())), 3)
    with pytest.raises(jaxtyping.TypeCheckError):
        f(jnp.ones((8, 2)), 3)


# Strings from jaxtyping's documentation of its grammar, each with arrays that pass
# and fail it: a `name=` prefix only documents (`foo=4` is 4), before or after a
# modifier.
_GRAMMAR = [
    ("foo=4", [(4,)], [(3,)]),
    ("bar qux foo=bar+qux", [(2, 3, 5)], [(2, 3, 4)]),
    ("bar #foo=bar", [(3, 3), (3, 1)], [(3, 2)]),
    ("bar foo=#bar", [(3, 3), (3, 1)], [(3, 2)]),
    ("rows=3 cols=4", [(3, 4)], [(4, 3)]),
    ("_*b d", [(2, 5, 3), (3,)], [()]),
    ("n=*b d", [(2, 5, 3), (3,)], [()]),
]


@pytest.mark.parametrize("text, passing, failing", _GRAMMAR)
def test_every_string_jaxtyping_accepts(text, passing, failing):
    """Each is made (long form and, sharded, the compact syntax) and checked as
    jaxtyping checks it."""
    ours = jaxshard.Float[np.ndarray, text]
    theirs = jaxtyping.Float[np.ndarray, text]
    sharded = jaxshard.Float[Array, text, P()]

    def verdicts(annotation, shapes, make):
        @jaxshard.jaxtyped(typechecker=beartype.beartype)
        def f(x: annotation):
            return x

        out = []
        for shape in shapes:
            try:
                f(make(shape))
                out.append(True)
            except jaxtyping.TypeCheckError:
                out.append(False)
        return out

    for shapes, expected in ((passing, True), (failing, False)):
        assert verdicts(theirs, shapes, np.zeros) == [expected] * len(shapes)
        assert verdicts(ours, shapes, np.zeros) == [expected] * len(shapes)
        assert verdicts(sharded, shapes, jnp.zeros) == [expected] * len(shapes)
    first = text.split()[0]
    if "*" not in first:
        compact = jaxshard.sharded(jaxshard.Float, f"[{first}/x]{text[len(first) :]}")
        assert compact.dim_str == text
        rest = [None] * (len(text.split()) - 1)
        assert jaxshard.partition_spec(compact) == P("x", *rest)
