"""Differential tests: each case is run with `jaxtyping.jaxtyped` and jaxtyping's
annotations, and with `jaxshard.jaxtyped` and jaxshard's (and, where the values are
jax arrays, jaxshard's annotations with the trivial spec `P()`), under beartype and
typeguard; the verdicts and exception types must agree."""

import dataclasses
import typing
from typing import NamedTuple, Optional, Union

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

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
    """`def f(a0: A0, a1: A1, ...) -> returned: return a0`, decorated by `lib`
    (`returned=None`: no return annotation)."""
    params = ", ".join(f"a{i}: A{i}" for i in range(len(annotations)))
    namespace = {f"A{i}": a for i, a in enumerate(annotations)}
    namespace["R"] = returned
    arrow = "" if returned is None else " -> R"
    exec(f"def f({params}){arrow}:\n    return a0", namespace)
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


def _compare(build, calls, typechecker, transform=None, sharded=True, expected=None):
    """`build(lib, spec)` gives a function's parameter annotations and return
    annotation, with `spec` (`None`: none) on each array annotation; the function
    (returning its first argument), decorated by each library and passed through
    `transform` (`jax.jit`, say), is called with each of `calls`. jaxtyping's
    verdicts are jaxshard's, and with `sharded` those of `P()` on each annotation."""
    variants = [(jaxtyping, None), (jaxshard, None)] + [(jaxshard, P())] * sharded

    def run(lib, spec, args):
        annotations, returned = build(lib, spec)
        f = _function(lib, typechecker, annotations, returned)
        return (transform or (lambda f: f))(f)(*args)

    verdicts = []
    for args in calls:
        kinds = [_outcome(lambda v=v: run(*v, args))[0] for v in variants]
        assert len(set(kinds)) == 1, (args, kinds)
        verdicts.append(kinds[0] == "ok")
    if expected is not None:
        assert verdicts == expected


def _array(lib, spec, dims, dtype="Float", array_type=Array):
    """`lib.<dtype>[array_type, dims]`, with `spec` as third item unless None."""
    cls = getattr(lib, dtype)
    return cls[array_type, dims] if spec is None else cls[array_type, dims, spec]


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


# --- dimension strings ---------------------------------------------------------------

# Every form of jaxtyping's grammar, alone and combined.
_STRINGS = ["b", "3", "_", "...", "*b", "#b", "*#b", "#*b", "_b", "*_b", "_*b", "*_"]
_STRINGS += ["b=3", "foo=b", "b=#3", "#3", "b+1", "2*b", "b-1", "dim-1", "", " "]
_STRINGS += ["b c", "b b", "*b c", "... c", "b ...", "b c=b+1", "a=3 b=a+1", "#b b"]
_STRINGS += ["b  c", "lambda", "1"]
_SHAPES = [(), (1,), (2,), (3,), (4,), (2, 3), (3, 3), (3, 4), (1, 3), (3, 1)]
_SHAPES += [(2, 2, 3), (3, 4, 5), (1, 1)]
_PAIRS = [((2, 3), (2, 3)), ((2, 3), (3, 3)), ((3,), (4,)), ((3,), (3,))]
_PAIRS += [((2, 2, 3), (2, 2, 3)), ((2, 2, 3), (1, 2, 3)), ((1,), (3,))]


@pytest.mark.parametrize("text", _STRINGS)
def test_each_dimension_string_checks_as_jaxtypings(text, typechecker):
    """One array, then two arrays under the same string (the dimensions shared), of
    many shapes: the same verdicts, the plain and the `P()` annotation alike."""

    def one(lib, spec):
        return [_array(lib, spec, text)], None

    def two(lib, spec):
        return [_array(lib, spec, text)] * 2, None

    _compare(one, [(z(s),) for s in _SHAPES], typechecker)
    _compare(two, [(z(a), z(b)) for a, b in _PAIRS], typechecker)


def test_some_verdicts_of_the_grammar(typechecker):
    """What the comparisons above rest on: the verdicts themselves."""
    cases = [
        ("*#b", [((2, 3), (1, 3)), ((2, 3), (3, 3))], [True, False]),
        ("b=#3", [((1,), (3,)), ((2,), (3,))], [True, False]),
        ("_b", [((2,), (3,))], [True]),
        ("b c=b+1", [((2, 3), (2, 3)), ((2, 3), (2, 4))], [True, False]),
    ]
    for text, pairs, expected in cases:
        two = lambda lib, spec, text=text: ([_array(lib, spec, text)] * 2, None)  # noqa: E731
        _compare(two, [(z(a), z(b)) for a, b in pairs], typechecker, expected=expected)


# Strings jaxtyping refuses when the annotation is made.
_REFUSED = ["*b *c", "... ...", "_3", "#", "_#b", "#_b", "*b=3", "b,c", "*b ..."]


@pytest.mark.parametrize("text", _REFUSED)
def test_a_string_jaxtyping_refuses_is_refused_alike(text):
    theirs = _outcome(lambda: jaxtyping.Float[np.ndarray, text])
    assert theirs[0] is not jaxtyping.TypeCheckError and theirs[0] != "ok"
    assert _outcome(lambda: jaxshard.Float[np.ndarray, text]) == theirs
    assert _outcome(lambda: jaxshard.Float[Array, text, P()]) == theirs


def test_tree_path_dimensions(typechecker):
    """`?b`: a size of its own at each leaf of a `PyTree[..., "T"]`."""

    def build(lib, spec):
        leaf, same = _array(lib, spec, "?b c"), _array(lib, spec, "c")
        return [lib.PyTree[leaf, "T"], same], None

    calls = [([z((2, 3)), z((4, 3))], z(3)), ([z((2, 3)), z((4, 5))], z(3))]
    calls += [([z((2, 3))], z(4)), ({"a": z((1, 3))}, z(3))]
    _compare(build, calls, typechecker, expected=[True, False, False, True])


# --- dtypes ---------------------------------------------------------------------------

_DTYPE_CLASSES = ["Float", "Int", "UInt", "Bool", "Complex", "Num", "Real", "Inexact"]
_DTYPE_CLASSES += ["Shaped", "Integer", "Float32", "Float16", "Float64", "BFloat16"]
_DTYPE_CLASSES += ["Int8", "Int4", "UInt8", "Complex64"]


def _values_of_each_dtype() -> list:
    import ml_dtypes

    kinds = [np.float32, np.float64, np.float16, np.int8, np.int32, np.uint8]
    kinds += [np.bool_, np.complex64, ml_dtypes.bfloat16]
    return [np.zeros(3, k) for k in kinds] + [jnp.zeros(3, jnp.bfloat16), z(3, int)]


@pytest.mark.parametrize("name", _DTYPE_CLASSES)
def test_dtype_classes(name, typechecker):
    values = _values_of_each_dtype()

    def build(lib, spec):
        array_type = Array if spec is not None else Array | np.ndarray
        return [_array(lib, spec, "n", name, array_type)], None

    _compare(build, [(v,) for v in values], typechecker, sharded=False)
    _compare(build, [(jnp.asarray(v),) for v in values], typechecker)


def test_keys(typechecker):
    def build(lib, spec):
        return [_array(lib, spec, "n", "Key"), _array(lib, spec, "n")], None

    keys, raw = jax.random.split(jax.random.key(0), 3), jax.random.PRNGKey(0)
    calls = [(keys, z(3)), (keys, z(4)), (jax.random.split(raw, 3), z(3))]
    _compare(build, calls, typechecker, expected=[True, False, False])

    def plain(lib, typechecker):
        return _function(lib, typechecker, [lib.PRNGKeyArray, lib.Key[Array, ""]])

    _agree(plain, [(keys[0], keys[1]), (raw, keys[0])], typechecker, [True, True])
    _agree(plain, [(keys[0], raw)], typechecker, [False])


class _Halves(jaxtyping.AbstractDtype):
    dtypes = ["float16", "bfloat16"]


class _Singles(jaxshard.AbstractDtype):
    dtypes = ["float32"]


@pytest.mark.parametrize("dtype", [_Halves, _Singles])
def test_a_users_dtype_class(dtype, typechecker):
    def make(lib, typechecker):
        return _function(lib, typechecker, [dtype[np.ndarray, "n"]])

    values = [np.zeros(3, np.float16), np.zeros(3, np.float32), np.zeros((3, 1))]
    expected = [dtype is _Halves, dtype is _Singles, False]
    _agree(make, [(v,) for v in values], typechecker, expected)


# --- array types ----------------------------------------------------------------------

_ARRAY_TYPES = [Array, np.ndarray, float, int, bool, jax.ShapeDtypeStruct]
_ARRAY_TYPES += [
    Array | float,
    np.ndarray | np.generic,
    np.float32,
    jaxtyping.ArrayLike,
]
_SCALARS = [1.0, 1, True, 1j, np.float32(1), np.float64(1), np.int32(1), np.bool_(1)]
_SCALARS += [np.array(1.0), jnp.float32(1), "s", None, z(3), z(()), np.zeros(3)]
_SCALARS += [jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), "int32")]


@pytest.mark.parametrize("array_type", _ARRAY_TYPES, ids=repr)
@pytest.mark.parametrize("dims", ["", "3", "n", "..."])
def test_scalars_and_other_array_types(array_type, dims, typechecker):
    for dtype in ("Float", "Int", "Shaped"):

        def make(lib, typechecker, dtype=dtype):
            return _function(lib, typechecker, [getattr(lib, dtype)[array_type, dims]])

        _agree(make, [(v,) for v in _SCALARS], typechecker)


def test_shape_dtype_structs_are_checked_for_shape(typechecker):
    def make(lib, typechecker):
        a, b = (lib.Float[jax.ShapeDtypeStruct, d] for d in ("b c", "c"))
        return _function(lib, typechecker, [a, b])

    s = jax.ShapeDtypeStruct
    calls = [(s((2, 3), "float32"), s((3,), "float32"))]
    calls += [(s((2, 3), "float32"), s((2,), "float32")), (s((2, 3), "int32"), z(3))]
    _agree(make, calls, typechecker, [True, False, False])


# --- containers, functions, classes ---------------------------------------------------


def _pair_of(lib, spec, dims="b"):
    return [_array(lib, spec, dims)] * 2


_CONTAINERS = {
    "pytree": (
        lambda lib, s: ([lib.PyTree[_array(lib, s, "b")], _array(lib, s, "b")], None),
        [([z(3), z(3)], z(3)), ([z(3), z(4)], z(3)), ({"a": z(3)}, z(4))]
        + [([z(3)], z(3, int)), ([1.0], z(3)), ([], z(3))],
        [True, False, False, False, False, True],
    ),
    "pytree structure": (
        lambda lib, s: ([lib.PyTree[_array(lib, s, "b"), "T"]] * 2, None),
        [([z(3), z(3)], [z(3), z(3)]), ([z(3), z(3)], (z(3), z(3)))]
        + [([z(3)], [z(3), z(3)]), ({"a": z(3)}, {"b": z(3)})],
        [True, False, False, False],
    ),
    "pytree structure prefix": (
        lambda lib, s: (
            [lib.PyTree[int, "T"], lib.PyTree[_array(lib, s, "b"), "T ..."]],
            None,
        ),
        [([1, 2], [[z(3)], [z(3)]]), ([1, 2, 3], [[z(3)], [z(3)]])],
        [True, False],
    ),
    "tuple": (
        lambda lib, s: ([tuple[_array(lib, s, "b"), _array(lib, s, "b c")]], None),
        [((z(3), z((3, 2))),), ((z(3), z((4, 2))),), ((z(3),),)],
        [True, False, False],
    ),
    "tuple of any length": (
        lambda lib, s: ([tuple[_array(lib, s, "b"), ...]], None),
        [((z(3), z(3)),), ((),)],
        [True, True],
    ),
    "dict": (
        lambda lib, s: ([dict[str, _array(lib, s, "b")], _array(lib, s, "b")], None),
        [({"a": z(3)}, z(3)), ({"a": z(4)}, z(3)), ({"a": z((3, 1))}, z(3))],
        [True, False, False],
    ),
    "list": (
        lambda lib, s: ([list[_array(lib, s, "b")], _array(lib, s, "b")], None),
        [([z(3)], z(3)), ([z(4)], z(3))],
        [True, False],
    ),
    "optional": (
        lambda lib, s: (
            [Optional[_array(lib, s, "b")], _array(lib, s, "b")],
            Optional[_array(lib, s, "b")],
        ),
        [(None, z(3)), (z(3), z(3)), (z(2), z(3)), (z((2, 2)), z(3))],
        [True, True, False, False],
    ),
    "union": (
        lambda lib, s: (
            [
                Union[_array(lib, s, "b c"), _array(lib, s, "b", "Int")],
                _array(lib, s, "b"),
            ],
            None,
        ),
        [(z((3, 2)), z(3)), (z(3, int), z(3)), (z(2, int), z(3)), (z(3), z(3))],
        [True, True, False, False],
    ),
    "union of shapes": (
        lambda lib, s: (
            [_array(lib, s, "b") | _array(lib, s, "b c"), _array(lib, s, "c")],
            None,
        ),
        [(z((3, 2)), z(2)), (z((3, 2)), z(3)), (z(3), z(5))],
        [True, False, True],
    ),
    "union of array types": (
        lambda lib, s: ([_array(lib, s, "b", "Float", Array | np.ndarray)] * 2, None),
        [(z(3), z(3)), (z(3), z(4))],
        [True, False],
    ),
    "return": (
        lambda lib, s: (
            [_array(lib, s, "b"), _array(lib, s, "c")],
            _array(lib, s, "c"),
        ),
        [(z(3), z(3)), (z(3), z(4))],
        [True, False],
    ),
    "scalars": (
        lambda lib, s: ([_array(lib, s, ""), _array(lib, s, "", "Shaped")], None),
        [(z(()), z((), int)), (z(1), z(())), (jnp.float32(1), jnp.int32(1))],
        [True, False, True],
    ),
    "symbolic": (
        lambda lib, s: (
            [_array(lib, s, d) for d in ("b", "b+1", "2*b c=b-1")],
            _array(lib, s, "b"),
        ),
        [(z(3), z(4), z((6, 2))), (z(3), z(3), z((6, 2))), (z(3), z(4), z((6, 3)))],
        [True, False, False],
    ),
    "variadic": (
        lambda lib, s: (
            [_array(lib, s, d) for d in ("*b c", "*#b c", "... c")],
            _array(lib, s, "*b c"),
        ),
        [(z((2, 3)), z((1, 3)), z((5, 3))), (z((2, 3)), z((3, 3)), z(3))]
        + [(z((2, 2, 3)), z((2, 1, 3)), z(3)), (z((2, 3)), z((2, 3)), z(4))],
        [True, False, True, False],
    ),
}


@pytest.mark.parametrize("case", list(_CONTAINERS))
@pytest.mark.parametrize("where", ["eager", "jit"])
def test_containers_and_signatures(case, where, typechecker):
    build, calls, expected = _CONTAINERS[case]
    if where == "jit":
        calls = [c for c in calls if all(_traceable(a) for a in c)]
        expected = None
    _compare(build, calls, typechecker, jax.jit if where == "jit" else None)
    if expected is not None:
        _compare(build, calls, typechecker, expected=expected)


def _traceable(x) -> bool:
    leaves = jax.tree.leaves(x)
    return all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)


@pytest.mark.parametrize("transform", ["vmap", "eval_shape", "jit of a 1-device mesh"])
def test_under_jax_transformations(transform, typechecker):
    def build(lib, spec):
        return _pair_of(lib, spec), _array(lib, spec, "b")

    if transform == "vmap":
        calls = [(z((2, 3)), z((2, 3))), (z((2, 3)), z((2, 4)))]
        _compare(build, calls, typechecker, jax.vmap, expected=[True, False])
        return
    if transform == "eval_shape":
        calls = [(z(3), z(3)), (z(3), z(4)), (z(3), z(3, int))]
        of = lambda f: lambda *a: jax.eval_shape(f, *a)  # noqa: E731
        _compare(build, calls, typechecker, of, expected=[True, False, False])
        return
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    x3, x4 = (jax.device_put(z(n), NamedSharding(mesh, P())) for n in (3, 4))
    for transform in (None, jax.jit):
        _compare(build, [(x3, x3), (x3, x4)], typechecker, transform, expected=None)
    _compare(build, [(x3, x3), (x3, x4)], typechecker, expected=[True, False])


def test_a_generator(typechecker):
    def make(lib, typechecker):
        @lib.jaxtyped(typechecker=typechecker)
        def g(x: lib.Float[Array, "b"]) -> typing.Iterator[lib.Float[Array, "b"]]:
            yield x
            yield z(5)

        return lambda x: list(g(x))

    _agree(make, [(z(3),), (z(5),), (z((2, 2)),)], typechecker)


def test_methods_classmethods_and_staticmethods(typechecker):
    def make(lib, typechecker):
        check = lib.jaxtyped(typechecker=typechecker)
        F = lib.Float[Array, "b"]

        class A:
            @check
            def method(self, x: F, y: F) -> F:
                return x

            @classmethod
            @check
            def inner(cls, x: F, y: F) -> F:
                return x

            @check
            @classmethod
            def outer(cls, x: F, y: F) -> F:
                return x

            @check
            @staticmethod
            def static(x: F, y: F) -> F:
                return x

        kinds = (A().method, A.inner, A.outer, A.static)
        return lambda *a: [k(*a) for k in kinds]

    _agree(make, [(z(3), z(3)), (z(3), z(4)), (z(3), "x")], typechecker)
    _agree(make, [(z(3), z(3))], typechecker, [True])


def test_other_callables(typechecker):
    """What jaxtyping cannot decorate (a partial, a callable instance, a builtin),
    jaxshard refuses alike; a bound method and a `functools.wraps` wrapper are
    checked alike."""
    import functools as ft

    F = jaxtyping.Float[Array, "b"]

    def base(x: F, y: F) -> F:
        return x

    class Callable:
        def __call__(self, x: F, y: F):
            return x

    cases = {
        "partial": (lambda: ft.partial(base, z(3)), (z(4),)),
        "instance": (Callable, (z(3), z(4))),
        "builtin": (lambda: len, ([1],)),
        "bound": (lambda: Callable().__call__, (z(3), z(4))),
        "wraps": (lambda: ft.wraps(base)(lambda *a: base(*a)), (z(3), z(4))),
    }
    for name, (target, args) in cases.items():
        theirs, ours = (
            _outcome(
                lambda lib=lib: lib.jaxtyped(typechecker=typechecker)(target())(*args)
            )
            for lib in _LIBS
        )
        assert theirs[0] == ours[0] != "ok", name


def test_dataclass_fields_checked_on_init(typechecker):
    def make(lib, typechecker):
        @lib.jaxtyped(typechecker=typechecker)
        @dataclasses.dataclass
        class D:
            x: lib.Float[Array, "b"]
            y: lib.Float[Array, "b c"]
            n: int = 3

            def __post_init__(self):
                assert isinstance(self.x, lib.Float[Array, "b"])

        return D

    calls = [(z(3), z((3, 2))), (z(3), z((4, 2))), (z(3), z((3, 2)), "s")]
    _agree(make, calls + [(z(3), "y")], typechecker, [True, False, False, False])


def test_namedtuple_arguments(typechecker):
    def make(lib, typechecker):
        class T(NamedTuple):
            a: lib.Float[Array, "b"]
            b: lib.Float[Array, "b"]

        f = _function(lib, typechecker, [T, lib.Float[Array, "b"]])
        return lambda a, b, y: f(T(a, b), y)

    # typeguard checks a NamedTuple's fields, beartype only its class: the same
    # with either library.
    calls = [(z(3), z(3), z(3)), (z(3), z(4), z(3)), (z(3), z(3), z(4))]
    _agree(make, calls, typechecker)


# --- where dimensions are remembered --------------------------------------------------


def test_nested_calls_have_their_own_dimensions(typechecker):
    def make(lib, typechecker):
        check = lib.jaxtyped(typechecker=typechecker)
        F = lib.Float[Array, "b"]

        @check
        def inner(x: F) -> F:
            return x

        @check
        def outer(x: F, y: lib.Float[Array, "c"]) -> F:
            inner(y)  # its own `b`
            return inner(z(7)) if x.shape == (1,) else x

        return outer

    _agree(make, [(z(3), z(4)), (z(3), z(3)), (z(1), z(2))], typechecker)
    _agree(make, [(z(3), z(4)), (z(1), z(2))], typechecker, [True, False])


@pytest.mark.parametrize("inner_lib", _LIBS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("jit", [False, True])
def test_a_failing_call_in_the_body_keeps_its_own_message(inner_lib, jit, typechecker):
    """The error of a checked call that a checked function makes is that call's:
    the outer function's decorator left its dimensions but showed its own arguments
    under "Called with parameters" ({'x': f32[3], 'y': f32[5]} for `inner`'s
    {'a': f32[5], 'b': f32[3]})."""
    F = jaxshard.Float[Array, "n"]

    @inner_lib.jaxtyped(typechecker=typechecker)
    def inner(a: F, b: F):
        return a

    @jaxshard.jaxtyped(typechecker=typechecker)
    def outer(x: F, y: jaxshard.Float[Array, "m"]):
        return inner(y, x)

    alone = _outcome(lambda: inner(z(5), z(3)))
    nested = _outcome(lambda: (jax.jit(outer) if jit else outer)(z(3), z(5)))
    assert nested[0] is alone[0] is jaxtyping.TypeCheckError
    called = [line for line in nested[1].splitlines() if line.startswith("Called")]
    assert called == ["Called with parameters: {'a': f32[5], 'b': f32[3]}"]
    if not jit:
        assert nested == alone


def _isinstance_pairs(lib, annotation_of, first, second):
    """`isinstance` of two arrays: outside any check, in a `typechecker=None`
    function, and in `jaxtyped("context")` (the two share their dimensions)."""
    annotation = annotation_of(lib)

    @lib.jaxtyped(typechecker=None)
    def inside(x, y):
        return isinstance(x, annotation), isinstance(y, annotation)

    with lib.jaxtyped("context"):
        context = (isinstance(first, annotation), isinstance(second, annotation))
    outside = (isinstance(first, annotation), isinstance(second, annotation))
    return outside, inside(first, second), context


@pytest.mark.parametrize("dims", ["b", "b c", "*b c", "#b", "_b", "b=3", "...", "b b"])
def test_isinstance_outside_and_inside_a_check(dims):
    plain = lambda lib: lib.Float[Array, dims]  # noqa: E731
    sharded = lambda lib: jaxshard.Float[Array, dims, P()]  # noqa: E731
    shapes = [(3,), (4,), (3, 3), (3, 4), (1,), (4, 3), (2, 3, 4), (1, 1)]
    for first in shapes:
        for second in shapes:
            theirs = _isinstance_pairs(jaxtyping, plain, z(first), z(second))
            assert _isinstance_pairs(jaxshard, plain, z(first), z(second)) == theirs
            assert _isinstance_pairs(jaxshard, sharded, z(first), z(second)) == theirs


def test_isinstance_results():
    """What the comparison above rests on: outside a check each `isinstance` binds
    afresh, inside one the second sees the first's `b`."""
    for annotation in (jaxshard.Float[Array, "b"], jaxshard.Float[Array, "b", P()]):
        outside, inside, context = _isinstance_pairs(
            jaxshard, lambda lib: annotation, z(3), z(4)
        )
        assert outside == (True, True) and inside == context == (True, False)


def test_the_context_manager_and_its_misuse():
    for lib in _LIBS:
        with lib.jaxtyped("context"):
            assert isinstance(z(3), lib.Float[Array, "b"])
            with lib.jaxtyped("context"):  # a scope of its own
                assert isinstance(z(4), lib.Float[Array, "b"])
            assert not isinstance(z(4), lib.Float[Array, "b"])
    import beartype

    misuses = [
        lambda lib: lib.jaxtyped("context", typechecker=beartype.beartype),
        lambda lib: lib.jaxtyped(typechecker=beartype.beartype)("context"),
    ]
    for misuse in misuses:
        theirs, ours = (_outcome(lambda lib=lib: misuse(lib)) for lib in _LIBS)
        assert theirs == ours and theirs[0] is ValueError


# --- drawn at random ------------------------------------------------------------------

_NAMES = ["a", "b", "c"]


@st.composite
def _dimension_strings(draw) -> str:
    name = st.sampled_from(_NAMES)
    fixed = [
        name,
        st.integers(1, 3).map(str),
        st.just("_"),
        name.map(lambda n: f"#{n}"),
        name.map(lambda n: f"_{n}"),
        name.map(lambda n: f"{n}+1"),
        name.map(lambda n: f"2*{n}"),
        name.map(lambda n: f"x={n}"),
    ]
    variadic = name.flatmap(
        lambda n: st.sampled_from(["...", f"*{n}", f"*#{n}", f"*_{n}", "*_"])
    )
    dims = draw(st.lists(st.one_of(fixed), max_size=3))
    if draw(st.booleans()):
        dims.insert(draw(st.integers(0, len(dims))), draw(variadic))
    return " ".join(dims)


_shapes = st.lists(st.integers(1, 4), max_size=4).map(tuple)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(
    texts=st.lists(_dimension_strings(), min_size=1, max_size=3),
    shapes=st.data(),
    checker=st.sampled_from(["beartype", "typeguard"]),
    jit=st.booleans(),
)
def test_drawn_signatures_check_as_jaxtypings(texts, shapes, checker, jit):
    """Strings of every form, the same names across parameters, arrays of drawn
    shapes (often the same); eager and in `jit`, with and without `P()`."""
    import beartype
    import typeguard

    typechecker = {"beartype": beartype.beartype, "typeguard": typeguard.typechecked}
    drawn = [shapes.draw(_shapes) for _ in texts]
    if len(drawn) > 1 and shapes.draw(st.booleans()):
        drawn[1] = drawn[0]

    def build(lib, spec):
        return [_array(lib, spec, t) for t in texts], None

    _compare(
        build,
        [tuple(z(s) for s in drawn)],
        typechecker[checker],
        jax.jit if jit else None,
    )


# --- the one difference by design -----------------------------------------------------


def test_a_registered_dataclass_rebuilt_by_jax(typechecker):
    """jaxtyping checks a decorated `register_dataclass` class's `__init__` whenever
    JAX rebuilds an instance from its leaves, and fails on leaves that are not
    arrays; jaxshard checks it only when the user makes one (its docstring says so).
    Everything else agrees."""

    def make(lib):
        @lib.jaxtyped(typechecker=typechecker)
        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class D:
            x: lib.Float[Array, "b"]
            y: lib.Float[Array, "b"]

        return D

    rebuilt = {
        "tree.map to shapes": lambda D: jax.tree.map(lambda a: a.shape, D(z(3), z(3))),
        "eval_shape": lambda D: jax.eval_shape(lambda d: d, D(z(3), z(3))),
    }
    made = {
        "made": lambda D: D(z(3), z(3)),
        "made wrong": lambda D: D(z(3), z(4)),
        "replace": lambda D: dataclasses.replace(D(z(3), z(3)), y=z(4)),
        "jit": lambda D: jax.jit(lambda d: d)(D(z(3), z(3))),
        "vmap": lambda D: jax.vmap(lambda d: d)(D(z((2, 3)), z((2, 3)))),
    }
    for name, use in rebuilt.items():
        theirs, ours = (_outcome(lambda lib=lib: use(make(lib)))[0] for lib in _LIBS)
        assert (theirs, ours) == (jaxtyping.TypeCheckError, "ok"), name
    for name, use in made.items():
        theirs, ours = (_outcome(lambda lib=lib: use(make(lib)))[0] for lib in _LIBS)
        assert theirs == ours, name
    assert "when JAX rebuilds one" in " ".join(jaxshard.jaxtyped.__doc__.split())
