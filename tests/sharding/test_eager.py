"""Concrete arrays: checked immediately, with messages that say what is wrong."""

import threading
import warnings

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import layer, put
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


def test_passes_and_fails(typechecker, jaxtyped, mesh):
    f = layer(jaxtyped, typechecker)
    x = put((8, 4), mesh, P("dp", None))
    w = put((4, 6), mesh, P(None, "tp"))
    out = f(x, w)
    assert out.shape == (8, 6)
    with pytest.raises(jaxtyping.TypeCheckError):
        f(put((8, 4), mesh, P(None, "tp")), w)
    with pytest.raises(jaxtyping.TypeCheckError):
        f(x, put((4, 6), mesh, P("dp", None)))


def test_jaxshard_message_names_everything(typechecker, mesh):
    f = layer(jaxshard.jaxtyped, typechecker)
    w = put((4, 6), mesh, P(None, "tp"))
    with pytest.raises(jaxshard.ShardingError) as info:
        f(put((8, 4), mesh, P(None, "tp")), w)
    msg = str(info.value)
    assert isinstance(info.value, jaxtyping.TypeCheckError)
    for fragment in [
        "helpers.layer.<locals>.f",  # the function
        "parameter 'x'",  # the parameter
        "P('dp', None)",  # expected
        "sharded as P(None, 'tp')",  # actual
        "{'dp': 4, 'tp': 2}",  # the mesh
        "float32[8,4]",  # dtype and shape
    ]:
        assert fragment in msg, fragment


def test_return_value_message(mesh):
    @jaxshard.jaxtyped(typechecker=__import__("beartype").beartype)
    def f(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        return jax.device_put(x, NamedSharding(mesh, P(None, "tp")))

    with pytest.raises(jaxshard.ShardingError, match="the return value: this array"):
        f(put((8, 4), mesh, P("dp")))


@pytest.mark.parametrize(
    "actual, expected",
    [
        (P("dp"), P("dp", None)),  # trailing None may be left out
        (P("dp", None), P("dp")),
        (P(("dp", "one")), P("dp")),  # size-1 mesh axes count as replicated
        (P("dp", "one"), P("dp", None)),
        (P(None, "tp"), P(P.UNCONSTRAINED, "tp")),
        (P("dp", "tp"), P(P.UNCONSTRAINED, "tp")),
        (P("dp", "tp"), P("dp", P.UNCONSTRAINED)),
    ],
)
def test_equivalent_specs_pass(actual, expected):
    mesh = jax.make_mesh((4, 2, 1), ("dp", "tp", "one"))
    ann = Float[Array, "b d", expected]
    assert isinstance(put((8, 4), mesh, actual), ann)


@pytest.mark.parametrize(
    "actual, expected",
    [
        (P("dp"), P(None, "dp")),
        (P(("dp", "tp")), P(("tp", "dp"))),  # order of axes matters
        (P("dp", "tp"), P(P.UNCONSTRAINED, None)),
        (P(), P("dp")),
    ],
)
def test_different_specs_fail(actual, expected):
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    assert not isinstance(put((8, 4), mesh, actual), Float[Array, "b d", expected])


def test_single_device_without_mesh_passes_any_spec():
    ann = Float[Array, "b d", P("dp", "tp")]
    x = jnp.ones((8, 4))
    assert len(x.sharding.device_set) == 1
    assert isinstance(x, ann)


def test_single_device_array_with_a_mesh_in_context_is_checked(explicit_mesh):
    ann = Float[Array, "b d", P("dp")]
    x = jax.device_put(jnp.ones((8, 4)), jax.devices()[0])
    with jax.set_mesh(explicit_mesh):
        reason = ann.__instancecheck_str__(x)
    assert "on one device" in reason
    assert "P('dp')" in reason and "{'dp': 4, 'tp': 2}" in reason
    one = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
    with jax.set_mesh(one):
        assert isinstance(x, ann)


def test_legacy_mesh_context(auto_mesh):
    ann = Float[Array, "b d", P("dp")]
    x = jax.device_put(jnp.ones((8, 4)), jax.devices()[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with auto_mesh:
            assert not isinstance(x, ann)


def test_axis_not_in_mesh(explicit_mesh):
    ann = Float[Array, "b d", P("fsdp")]
    reason = ann.__instancecheck_str__(put((8, 4), explicit_mesh, P("dp")))
    assert "names mesh axis 'fsdp'" in reason
    assert "has axes 'dp', 'tp'" in reason


def test_numpy_and_scalars_have_no_sharding():
    ann = Float[np.ndarray | Array, "b", P("dp")]
    assert not isinstance(np.ones(4, np.float32), ann)
    reason = ann.__args__[0].__instancecheck_str__(np.ones(4, np.float32))
    assert "numpy.ndarray, which has no sharding" in reason
    assert "P('dp')" in reason


def test_spec_longer_than_a_variadic_array(explicit_mesh):
    ann = Float[Array, "*b d", P("dp", "tp")]
    reason = ann.__instancecheck_str__(put((8,), explicit_mesh, P("dp")))
    assert "has 2 entries but the array has 1 dimensions" in reason


def test_failure_leaves_no_state_behind(explicit_mesh):
    """A sharding failure must not leave jaxtyping's dim bindings behind."""
    good = put((8, 4), explicit_mesh, P("dp"))
    bad = put((16, 4), explicit_mesh, P(None, "tp"))
    with jaxtyping.jaxtyped("context"):
        assert not isinstance(bad, Float[Array, "b d", P("dp")])
        # `b` was not bound to 16 by the failed check:
        assert isinstance(good, Float[Array, "b d", P("dp")])

    f = layer(jaxshard.jaxtyped, __import__("beartype").beartype)
    w = put((4, 6), explicit_mesh, P(None, "tp"))
    with pytest.raises(jaxshard.ShardingError):
        f(bad, w)
    assert f(good, w).shape == (8, 6)


def test_threads_with_different_meshes_do_not_interfere():
    """Each thread has its own mesh, its own config scope and its own dim memo."""
    devices = jax.devices()
    meshes = [
        jax.make_mesh((4,), ("dp",), devices=devices[:4]),
        jax.make_mesh((2, 2), ("dp", "tp"), devices=devices[4:]),
    ]
    ann = Float[Array, "b d", P("dp")]
    errors = []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            mesh = meshes[i]
            x = jax.device_put(jnp.ones((8, 4)), devices[4 * i])
            with jax.set_mesh(mesh), jaxshard.config(sharding="off" if i else "check"):
                barrier.wait()
                for _ in range(50):
                    # thread 0 checks (single-device array vs a 4-device mesh: fails);
                    # thread 1 has checks off: passes
                    assert isinstance(x, ann) == bool(i)
                    good = put((8, 4), mesh, P("dp"))
                    assert isinstance(good, ann)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("value", [np.ones((8, 4), np.float32), 1.0, np.float32(2)])
def test_numpy_or_scalar_for_a_sharded_jax_array(value):
    @jaxshard.jaxtyped(typechecker=__import__("beartype").beartype)
    def f(x: Float[Array, "...", P("dp")]):
        return x

    with pytest.raises(jaxshard.ShardingError, match="which has no sharding"):
        f(value)


def test_none_in_an_optional_leaves_no_note(explicit_mesh):
    from typing import Optional

    @jaxshard.jaxtyped(typechecker=__import__("beartype").beartype)
    def f(a: Optional[Float[Array, "b", P("dp")]], b: Float[Array, "b", P("dp")]):
        return b

    with pytest.raises(jaxshard.ShardingError) as info:
        f(None, put((8,), explicit_mesh, P()))
    assert "NoneType" not in str(info.value)
    assert "parameter 'b'" in str(info.value)
