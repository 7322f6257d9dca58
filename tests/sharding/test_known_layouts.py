"""The eager fast path: a layout that passed an annotation's check is remembered, and
every verdict stays what the full check says, whatever changed since."""

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._sharding import layout


def _put(shape, mesh, spec):
    return jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))


def _reason(annotation, x) -> str:
    return type(annotation).__instancecheck_str__(annotation, x)


def test_a_known_layout_passes_and_others_still_fail(explicit_mesh):
    X = Float[Array, "b d", P("dp", None)]
    good = _put((8, 4), explicit_mesh, P("dp", None))
    bad = _put((8, 4), explicit_mesh, P(None, "tp"))
    assert isinstance(good, X)
    assert X._passed  # remembered
    assert isinstance(good, X)
    for _ in range(2):  # a failure is never remembered: said in full each time
        assert "but the annotation expects P('dp', None)" in _reason(X, bad)
    assert isinstance(_put((8, 4), explicit_mesh, P("dp", None)), X)  # equal sharding
    # jaxtyping's part is checked on the fast path too, with its full message.
    assert not isinstance(_put((8, 5, 1), explicit_mesh, P("dp", None)), X)
    assert "dtype" in _reason(X, good.astype(jnp.int32))


def test_shape_failures_after_a_pass_say_everything(explicit_mesh):
    X = Float[Array, "b 4", P("dp", None)]
    assert isinstance(_put((8, 4), explicit_mesh, P("dp", None)), X)
    reason = _reason(X, _put((8, 6), explicit_mesh, P("dp", None)))
    assert "6 does not equal 4" in reason


def test_variadic_rank_is_part_of_the_verdict(explicit_mesh):
    X = Float[Array, "*b d", P("dp")]
    assert isinstance(_put((8, 4), explicit_mesh, P("dp", None)), X)
    assert isinstance(_put((8, 2, 2), explicit_mesh, P("dp", None, None)), X)
    assert not isinstance(_put((8,), explicit_mesh, P("dp")), Float[Array, "b d"])


def test_off_is_not_remembered_as_a_pass(explicit_mesh):
    X = Float[Array, "b d", P("dp", None)]
    bad = _put((8, 4), explicit_mesh, P(None, "tp"))
    with jaxshard.config(sharding="off"):
        assert isinstance(bad, X)
    assert not X._passed
    assert not isinstance(bad, X)


def test_logical_verdicts_follow_the_rules(explicit_mesh):
    X = Float[Array, "batch d", jaxshard.L("batch", None)]
    x = _put((8, 4), explicit_mesh, P("dp", None))
    with jaxshard.axis_rules([("batch", "dp")]):
        assert isinstance(x, X)
        assert isinstance(x, X)
    with jaxshard.axis_rules([("batch", "tp")]):
        assert not isinstance(x, X)
    with jaxshard.axis_rules([("batch", "dp")]):
        assert isinstance(x, X)
    assert "no axis rules are in force" in _reason(X, x)


def test_one_device_arrays_follow_the_mesh_in_context(explicit_mesh):
    X = Float[Array, "b d", P("dp", None)]
    x = jnp.ones((8, 4))  # uncommitted, on one device
    assert isinstance(x, X)  # no mesh: code for a pod, run on one device
    assert isinstance(x, X)
    with jax.set_mesh(explicit_mesh):
        assert "uncommitted" in _reason(X, x)
    assert isinstance(x, X)


def test_the_fast_path_takes_one_device_arrays(explicit_mesh):
    """Code annotated for a pod, run on one device: the arrays' shardings name no
    mesh, and the verdict is kept with the mesh in context and whether the array is
    committed; the shape is still bound as jaxtyping binds it."""
    X = Float[Array, "b d", P("dp", None)]

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: X, y: X):
        return x

    for _ in range(3):
        f(jnp.ones((8, 4)), jnp.ones((8, 4)))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'y'"):
        f(jnp.ones((8, 4)), jnp.ones((8, 5)))
    committed = jax.device_put(jnp.ones((8, 4)), jax.devices()[0])
    with jax.set_mesh(explicit_mesh):
        for x in (jnp.ones((8, 4)), committed):  # on one device, the mesh has 8
            with pytest.raises(jaxshard.ShardingError):
                f(x, x)
    f(committed, committed)


def test_a_value_that_is_no_array_gets_jaxtypings_answer():
    """What `PyTree[...]` asks about a tree's nodes: jaxtyping's verdict, at once;
    an array-like value without a sharding still hears that it has none."""
    X = Float[Array, "b d", P("dp", None)]
    plain = jaxtyping.Float[Array, "b d"]
    for obj in ({"a": 1}, [1, 2], "text", None, object()):
        assert _reason(X, obj) == type(plain).__instancecheck_str__(plain, obj) != ""
    assert "no sharding" in _reason(X, np.ones((2, 3)))


def test_the_known_layouts_are_bounded(explicit_mesh):
    X = Float[Array, "b d", P()]
    devices = explicit_mesh.devices.ravel()
    for i in range(3 * layout._KNOWN):
        mesh = jax.make_mesh((1,), ("dp",), devices=[devices[i % 8]])
        shape = (1 + i // 8, 4)  # a new sharding object each time
        x = jax.device_put(jnp.ones(shape), NamedSharding(mesh, P()))
        assert isinstance(x, X)
    assert len(X._passed) <= layout._KNOWN


@pytest.mark.parametrize("jaxtyped", [jaxshard.jaxtyped])
def test_decorated_calls_fail_after_passing_ones(explicit_mesh, jaxtyped):
    @jaxtyped
    def f(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d"]:
        return x

    good = _put((8, 4), explicit_mesh, P("dp", None))
    for _ in range(3):
        f(good)
    with pytest.raises(jaxshard.ShardingError, match="sharded as P\\(None, 'tp'\\)"):
        f(_put((8, 4), explicit_mesh, P(None, "tp")))


def test_the_fast_path_binds_dimensions_as_jaxtyping_does(explicit_mesh):
    A = Float[Array, "a 4", P("dp", None)]
    B = Float[Array, "b a", P("dp", None)]
    C = Float[Array, "_ a", P()]

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: A | B, y: C):
        return x

    for _ in range(3):  # the layouts and dtypes known: the fast path from now on
        f(_put((8, 4), explicit_mesh, P("dp", None)), _put((8, 8), explicit_mesh, P()))
    # A fails on its second dimension after binding `a`; B must not see that `a`.
    f(_put((8, 5), explicit_mesh, P("dp", None)), _put((2, 5), explicit_mesh, P()))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'y'"):
        f(_put((8, 4), explicit_mesh, P("dp", None)), _put((8, 5), explicit_mesh, P()))
    with pytest.raises(jaxtyping.TypeCheckError, match="dimensions"):  # the rank
        f(_put((8, 4), explicit_mesh, P("dp", None)), _put((8,), explicit_mesh, P()))


def test_the_fast_path_binds_variadic_dimensions_as_jaxtyping_does(explicit_mesh):
    A = Float[Array, "*a d", P()]
    B = Float[Array, "... d", P()]
    C = Float[Array, "*#a", P()]  # broadcastable: checked by jaxtyping

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: A, y: A, z: B):
        return x

    def call(x, y, z=(4,)):
        f(*(_put(s, explicit_mesh, P()) for s in (x, y, z)))

    for _ in range(3):  # the layouts and dtypes known: the fast path from now on
        call((8, 2, 4), (8, 2, 4), (1, 2, 4))
    call((5,), (5,), (7, 7, 7, 5))  # `*a` is () here
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'z'"):
        call((8, 2, 4), (8, 2, 4), (1, 2, 5))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'y'"):
        call((8, 2, 4), (8, 3, 4))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'y'"):
        call((8, 4), (4,))  # `*a` (8,) then ()
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        call((), (4,))  # fewer dimensions than the fixed ones

    @jaxshard.jaxtyped(typechecker=beartype)
    def g(x: C, y: A):
        return x

    for _ in range(2):  # `*#a` bound (1, 4): `*a` (3, 4) broadcasts with it
        g(_put((1, 4), explicit_mesh, P()), _put((3, 4, 2), explicit_mesh, P()))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'y'"):
        g(_put((2, 4), explicit_mesh, P()), _put((3, 4, 2), explicit_mesh, P()))


def test_the_fast_path_of_logical_annotations_follows_the_rules(explicit_mesh):
    X = Float[Array, "b d", jaxshard.L("batch", None)]
    x = _put((8, 4), explicit_mesh, P("dp", None))
    with jaxshard.axis_rules([("batch", "dp")]):
        assert isinstance(x, X) and isinstance(x, X)
    with jaxshard.axis_rules([("batch", "tp")]):  # another spec: not known
        for _ in range(2):
            assert "expects P('tp', None)" in _reason(X, x)
            assert not isinstance(x, X)
    with jaxshard.axis_rules([("batch", "dp")]):
        assert isinstance(x, X)
    for _ in range(2):  # no rules: the full check says so
        assert "no axis rules are in force" in _reason(X, x)
        assert not isinstance(x, X)


def test_the_fast_path_knows_dtypes_by_what_passed(explicit_mesh):
    X = Float[Array, "b d", P("dp", None)]
    x = _put((8, 4), explicit_mesh, P("dp", None))
    for _ in range(2):
        assert isinstance(x, X)
        assert isinstance(x.astype(jnp.bfloat16), X)  # a Float too
        assert not isinstance(x.astype(jnp.int32), X)
        assert not isinstance(x.astype(jnp.bool_), X)
    assert not isinstance(x.astype(jnp.int32), jaxshard.Float32[Array, "b d", P()])


def test_a_transparent_annotation_leaves_the_fast_path(explicit_mesh):
    X = Float[Array, "b d", P("dp", None)]
    x = _put((8, 4), explicit_mesh, P("dp", None))
    assert isinstance(x, X) and isinstance(x, X)

    @jaxshard.jaxtyped(typechecker=None)
    def numbers() -> Iterator[X]:  # jaxtyping stops checking a generator's yields
        yield x

    assert len(list(numbers())) == 1
    assert X._fast[0] is None
    # As jaxtyping's own annotation, which then passes anything.
    assert isinstance(x.astype(jnp.int32), X)
