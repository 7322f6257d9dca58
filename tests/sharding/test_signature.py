"""Shardings, shard_map specs and abstract inputs read off annotations."""

import typing
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, Int, Key, Shaped


class Params(eqx.Module):
    w: Float[Array, "d f", P(None, "tp")]
    b: Float[Array, "f", P("tp")]
    scale: float  # a leaf with no array annotation


class Batch(NamedTuple):
    x: Float[Array, "batch d", P("dp")]
    y: Int[Array, "batch", P("dp")]


def step(
    params: Params,
    batch: Batch,
    key: Key[Array, ""],
    pair: tuple[Float[Array, "d", P()], Float[Array, "f"]],
    lr: float = 0.1,
) -> tuple[Float[Array, "batch f", P("dp", "tp")], Float[Array, ""]]:
    raise NotImplementedError


def test_shardings_follow_the_annotations(auto_mesh):
    ins, out = jaxshard.shardings(step, auto_mesh)
    params, batch, key, pair, lr = ins

    def spec(s):
        assert isinstance(s, NamedSharding) and s.mesh == auto_mesh
        return s.spec

    assert isinstance(params, Params)
    assert spec(params.w) == P(None, "tp") and spec(params.b) == P("tp")
    assert params.scale is None
    assert isinstance(batch, Batch) and spec(batch.x) == P("dp")
    assert spec(batch.y) == P("dp")
    assert key is None and lr is None
    assert spec(pair[0]) == P() and pair[1] is None
    assert spec(out[0]) == P("dp", "tp") and out[1] is None


def test_shardings_drive_jit(explicit_mesh):
    @jaxshard.jaxtyped(typechecker=__import__("beartype").beartype)
    def f(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
    ) -> Float[Array, "b f", P("dp", "tp")]:
        return x @ w

    ins, out = jaxshard.shardings(f, explicit_mesh)
    g = jax.jit(f, in_shardings=ins, out_shardings=out)
    y = g(jnp.ones((8, 4)), jnp.ones((4, 2)))  # placed by jit, then checked
    assert y.sharding.spec == P("dp", "tp")


def test_shardings_mesh_from_context(auto_mesh):
    def f(x: Float[Array, "b", P("dp")]): ...

    with pytest.raises(ValueError, match="needs a mesh"):
        jaxshard.shardings(f)
    with jax.set_mesh(auto_mesh):
        (s,), _ = jaxshard.shardings(f)
    assert s.mesh == auto_mesh and s.spec == P("dp")


def test_open_structures_give_a_tree_prefix(auto_mesh):
    def f(
        a: jaxtyping.PyTree[Float[Array, "..."], "T"],
        b: jaxtyping.PyTree[Float[Array, "n"]],  # no spec
        c: dict[str, Float[Array, "n", P("dp")]],
        d: list[Float[Array, "n", P("dp")] | None],
    ) -> jaxtyping.PyTree[Float[Array, "b d", P("dp", None)]]: ...

    (a, b, c, d), out = jaxshard.shardings(f, auto_mesh)
    assert a is None and b is None
    assert c.spec == P("dp") and d.spec == P("dp") and out.spec == P("dp", None)
    # A prefix is what jit wants: every leaf of the dict gets it.
    g = jax.jit(lambda c: c, in_shardings=(c,))
    lowered = g.lower({"u": jnp.ones(8), "v": jnp.ones(8)})
    shardings = lowered.compile().input_shardings[0][0]
    assert [s.spec for s in shardings.values()] == [P("dp"), P("dp")]


def test_open_structure_with_different_specs_is_an_error(auto_mesh):
    def f(
        a: list[tuple[Float[Array, "n", P("dp")], Float[Array, "n", P("tp")]]],
    ): ...

    with pytest.raises(jaxtyping.AnnotationError, match="different shardings") as e:
        jaxshard.shardings(f, auto_mesh)
    # A path into a parameter is named as one, not as "parameter 'a'[...]".
    assert str(e.value).startswith("jaxshard.shardings(f), parameter 'a': ")


def test_union_of_specs_is_an_error(auto_mesh):
    def f(a: Float[Array, "n", P("dp")] | Float[Array, "n m", P("tp")]): ...

    with pytest.raises(jaxtyping.AnnotationError, match="several partition specs"):
        jaxshard.shardings(f, auto_mesh)


def test_abstract_args(auto_mesh):
    dims = {"batch": 8, "d": 4, "f": 6}
    with pytest.raises(ValueError) as e:
        jaxshard.abstract_args(step, auto_mesh, dims)
    # `Params.scale` has no array annotation and no default.
    assert "params.scale" in str(e.value) and "values=" in str(e.value)

    class P2(eqx.Module):
        w: Float[Array, "d f", P(None, "tp")]
        b: Float[Array, "f", P("tp")]
        scale: float = 1.0

    def step2(params: P2, batch: Batch, key: Key[Array, ""], lr: float = 0.1): ...

    params, batch, key, lr = jaxshard.abstract_args(step2, auto_mesh, dims)
    assert params.w.shape == (4, 6) and params.w.dtype == jnp.float32
    assert params.w.sharding == NamedSharding(auto_mesh, P(None, "tp"))
    assert params.scale == 1.0
    assert batch.x.shape == (8, 4) and batch.y.dtype == jnp.int32
    assert batch.y.sharding.spec == P("dp")
    assert key.shape == () and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert lr == 0.1


def test_abstract_args_lowers(auto_mesh):
    def f(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
    ) -> Float[Array, "b f"]:
        return x @ w

    args = jaxshard.abstract_args(f, auto_mesh, {"b": 8, "d": 4, "f": 2})
    compiled = jax.jit(f).lower(*args).compile()
    assert compiled.input_shardings[0][0].spec == P("dp")


def test_dims_variadic_symbolic_and_fixed(auto_mesh):
    def f(
        x: Float[Array, "*batch d", P("dp")],
        y: Float[Array, "... 3 d-1"],
        z: Shaped[Array, "_ #d"],
    ): ...

    with pytest.raises(ValueError) as e:
        jaxshard.abstract_args(f, auto_mesh, {"d": 5})
    message = str(e.value)
    assert "'batch' (in x)" in message and "'...' (in y)" in message
    assert "'_' (in z)" in message and "dims=" in message
    x, y, z = jaxshard.abstract_args(
        f, auto_mesh, {"batch": (4, 2), "d": 5, "...": (), "_": 7}
    )
    assert x.shape == (4, 2, 5) and y.shape == (3, 4) and z.shape == (7, 5)
    assert z.dtype == jnp.float32 and z.sharding is None


def test_all_unbound_dims_in_one_error(auto_mesh):
    def f(x: Float[Array, "a b"], y: Float[Array, "c a"]): ...

    with pytest.raises(ValueError) as e:
        jaxshard.abstract_args(f, auto_mesh, {})
    assert "'a' (in x, y); 'b' (in x); 'c' (in y)" in str(e.value)


def test_uneven_and_unknown_axes(auto_mesh):
    def f(x: Float[Array, "b", P("dp")], y: Float[Array, "b", P("sp")]): ...

    with pytest.raises(ValueError) as e:
        jaxshard.abstract_args(f, auto_mesh, {"b": 6})
    assert "size 6, which P('dp') splits 4 ways" in str(e.value)
    assert "y: the annotation's spec P('sp') names mesh axis 'sp'" in str(e.value)
    assert "has axes 'dp', 'tp'" in str(e.value)


def test_dtypes(auto_mesh):
    def f(x: Float[Array, "n"], y: Int[Array, "n"], z: Float[Array, "n"]): ...

    dims = {"n": 4}
    x, y, z = jaxshard.abstract_args(f, auto_mesh, dims, jnp.bfloat16)
    assert x.dtype == jnp.bfloat16 and y.dtype == jnp.int32  # Int can't be bf16
    by_class = jaxshard.abstract_args(f, auto_mesh, dims, {jaxshard.Int: np.int8})
    assert by_class[1].dtype == np.int8
    by_name = jaxshard.abstract_args(
        f, auto_mesh, dims, {"Float": jnp.float16, "z": jnp.bfloat16}
    )
    assert by_name[0].dtype == jnp.float16 and by_name[2].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="allows only"):
        jaxshard.abstract_args(f, auto_mesh, dims, {"y": jnp.float32})


def test_pytree_needs_structure_for_abstract_args(auto_mesh):
    def f(x: jaxtyping.PyTree[Float[Array, "n", P("dp")]]): ...

    with pytest.raises(jaxtyping.AnnotationError, match="does not fix the structure"):
        jaxshard.abstract_args(f, auto_mesh, {"n": 8})
    tree = {"a": jax.ShapeDtypeStruct((8,), jnp.float32)}
    assert jaxshard.abstract_args(f, auto_mesh, {"n": 8}, values={"x": tree}) == (tree,)


def test_values_must_name_parameters(auto_mesh):
    def f(x: Float[Array, "n"]): ...

    with pytest.raises(ValueError, match="'y', which is not a parameter"):
        jaxshard.abstract_args(f, auto_mesh, {"n": 2}, values={"y": 1})


def test_jitted_function(auto_mesh):
    @jax.jit
    def f(x: Float[Array, "n", P("dp")]) -> Float[Array, "n", P("dp")]:
        return x

    (s,), out = jaxshard.shardings(f, auto_mesh)
    assert s.spec == P("dp") and out.spec == P("dp")
    (x,) = jaxshard.abstract_args(f, auto_mesh, {"n": 8})
    assert x.shape == (8,)


def test_partition_spec():
    assert jaxshard.partition_spec(Float[Array, "a b", P("dp")]) == P("dp")
    assert jaxshard.partition_spec(Float[Array, "a b"]) is None
    optional = typing.Optional[Float[Array | np.ndarray, "a", P("dp")]]
    assert jaxshard.partition_spec(optional) == P("dp")


# --- shard_map ------------------------------------------------------------------------


def test_shard_map_from_annotations(explicit_mesh):
    def local(
        x: Float[Array, "b d", P("dp")], w: Float[Array, "d f", P(None, "tp")]
    ) -> Float[Array, "b f", P("dp", "tp")]:
        return x @ w

    f = jax.jit(jaxshard.shard_map(local, mesh=explicit_mesh))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit_mesh, P("dp")))
    w = jax.device_put(jnp.ones((4, 6)), NamedSharding(explicit_mesh, P(None, "tp")))
    y = f(x, w)
    assert y.shape == (8, 6) and y.sharding.spec == P("dp", "tp")
    np.testing.assert_allclose(y, 4.0)


def test_shard_map_checks_blocks(explicit_mesh):
    # The annotation says the global array has 8 rows; give it 16.
    @jaxshard.shard_map(mesh=explicit_mesh)
    def local(x: Float[Array, "8 d", P("dp")]) -> Float[Array, "8 d", P("dp")]:
        return x

    x = jax.device_put(jnp.ones((16, 4)), NamedSharding(explicit_mesh, P("dp")))
    with pytest.raises(jaxtyping.TypeCheckError, match="global shape"):
        jax.jit(local)(x)


def test_shard_map_checks_varying_axes(explicit_mesh):
    @jaxshard.shard_map(mesh=explicit_mesh)
    def local(x: Float[Array, "b", P("dp")]) -> Float[Array, "", P()]:
        return x.sum()  # varies over dp (no psum), but the return says replicated

    x = jax.device_put(jnp.ones(8), NamedSharding(explicit_mesh, P("dp")))
    with pytest.raises(jaxshard.ShardingError, match="differs across"):
        jax.jit(local)(x)


def test_shard_map_context_mesh_and_overrides(auto_mesh):
    def local(x: Float[Array, "b", P("dp")], y) -> Float[Array, "b", P("dp")]:
        return x + y

    with pytest.raises(jaxtyping.AnnotationError, match="parameter 'y' has no"):
        jaxshard.shard_map(local)
    with jax.set_mesh(auto_mesh):
        f = jaxshard.shard_map(local, in_specs=(P("dp"), P()), out_specs=P("dp"))
        out = jax.jit(f)(jnp.arange(8.0), jnp.ones(()))
    np.testing.assert_allclose(out, np.arange(8.0) + 1)


def test_shard_map_needs_return_spec(auto_mesh):
    def local(x: Float[Array, "b", P("dp")]):
        return x

    with pytest.raises(jaxtyping.AnnotationError, match="return annotation"):
        jaxshard.shard_map(local, mesh=auto_mesh)
