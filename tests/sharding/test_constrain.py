"""`jaxshard.constrain`: a sharding constraint from an annotation, checked, inside jit
on Auto, Explicit and mixed meshes, and eagerly."""

import jax
import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, Int, L


RULES = [("batch", "dp"), ("embed", "tp")]
Act = Float[Array, "b s d", L("batch", None, "embed")]


@pytest.fixture(scope="module", params=["auto", "explicit", "mixed"])
def mesh(request):
    kinds = {
        "auto": (AxisType.Auto,) * 2,
        "explicit": (AxisType.Explicit,) * 2,
        "mixed": (AxisType.Explicit, AxisType.Auto),
    }[request.param]
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=kinds)


def spec(x) -> P:
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def test_inside_jit_lays_out_as_annotated(mesh):
    x = jax.device_put(jnp.ones((8, 4, 6)), NamedSharding(mesh, P(None, None, "tp")))

    @jax.jit
    def f(x):
        y = jaxshard.constrain(x * 2, Act)
        return y, jaxshard.constrain(y + 1, P(None, "tp"))

    with jax.set_mesh(mesh), jaxshard.axis_rules(RULES):
        y, z = f(x)
    assert spec(y) == P("dp", None, "tp")
    assert spec(z) == P(None, "tp")


def test_explicit_type_follows(explicit_mesh):
    """On Explicit axes the value's type changes (reshard), so later code sees it."""
    seen = []

    @jax.jit
    def f(x):
        y = jaxshard.constrain(x, Float[Array, "b d", P(None, "tp")])
        seen.append(jax.typeof(y).sharding.spec)
        return y

    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit_mesh, P("dp")))
    with jax.set_mesh(explicit_mesh):
        f(x)
    assert seen == [P(None, "tp")]


def test_eager_and_mesh_argument(auto_mesh):
    x = jnp.arange(32.0).reshape(8, 4)
    y = jaxshard.constrain(x, P("dp", "tp"), mesh=auto_mesh)
    assert spec(y) == P("dp", "tp") and (y == x).all()
    z = jaxshard.constrain(y, L("batch"), rules=RULES)  # y's own mesh
    assert spec(z) == P("dp")


def test_unconstrained_keeps_the_layout(explicit_mesh):
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit_mesh, P("dp")))
    with jax.set_mesh(explicit_mesh):
        out = jax.jit(lambda x: jaxshard.constrain(x, P(P.UNCONSTRAINED, "tp")))(x)
    assert spec(out) == P("dp", "tp")


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_unconstrained_onto_a_mesh_without_the_values_axis(kind):
    """Eagerly onto another mesh: an unconstrained dimension keeps the value's
    layout, whose axis that mesh may lack (JAX's own error was a ValueError)."""
    on_dp = jax.make_mesh((8,), ("dp",), axis_types=(kind,))
    xy = jax.make_mesh((4, 2), ("x", "y"), axis_types=(kind, kind))
    x = jax.device_put(jnp.ones((64, 8)), NamedSharding(on_dp, P("dp")))
    Loose = Float[Array, "b d", P(P.UNCONSTRAINED, "y")]
    runs = [
        lambda: jaxshard.constrain(x, Loose, mesh=xy),
        lambda: jaxshard.constrain(x, P(P.UNCONSTRAINED, "y"), mesh=xy),
    ]
    if kind == AxisType.Explicit:  # traced, it keeps the layout of its type
        runs.append(lambda: jax.jit(lambda x: jaxshard.constrain(x, Loose))(x))
    for run in runs:
        with jax.set_mesh(xy), pytest.raises(jaxshard.ShardingError) as e:
            run()
        text = str(e.value)
        assert text.startswith(
            f"jaxshard.constrain: mesh {{'x': 4, 'y': 2}} ({kind.name} axes) has no "
            "axis 'dp' (its axes are 'x', 'y'), which the annotation's spec "
            "P(P.UNCONSTRAINED, 'y') keeps in dimension 0: P.UNCONSTRAINED keeps "
            "the layout the value (float32[64,8]) has, P('dp'"
        )
        assert "on mesh {'dp': 8}" in text
        assert "P(None, 'y') to replicate them" in text
        assert "or constrain the value on the mesh it is on." in text
    three = jax.sharding.Mesh(jax.devices()[:3], ("dp",), axis_types=(kind,))
    with pytest.raises(jaxshard.ShardingError) as e:
        jaxshard.constrain(x, P(P.UNCONSTRAINED), mesh=three)
    assert str(e.value).startswith(
        "jaxshard.constrain: the annotation's spec P(P.UNCONSTRAINED) is P('dp') for "
        "this value, and P('dp') splits dimension 0 (of size 64) over 'dp' (3 "
        "devices)"
    )
    # Where the mesh has the axis it is kept; where it names the dimension, laid out.
    assert spec(jaxshard.constrain(x, P(P.UNCONSTRAINED), mesh=on_dp)) == P("dp")
    assert spec(jaxshard.constrain(x, P("x", "y"), mesh=xy)) == P("x", "y")


def test_wrong_shape_or_dtype_is_a_type_check_error(auto_mesh):
    with jax.set_mesh(auto_mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.TypeCheckError) as e:
            jax.jit(lambda x: jaxshard.constrain(x, Act))(jnp.ones((8, 4)))
        text = str(e.value)
        assert text.startswith("jaxshard.constrain: the value (float32[8,4])")
        assert "Float[Array, 'b s d', L('batch', None, 'embed')]" in text
        with pytest.raises(jaxshard.TypeCheckError, match="dtype"):
            jaxshard.constrain(jnp.ones(8), Int[Array, "n", P("dp")])
        with pytest.raises(jaxshard.TypeCheckError, match="has 2 entries"):
            jaxshard.constrain(jnp.ones(8), P("dp", "tp"))


def test_binds_dims_with_the_enclosing_function(auto_mesh):
    @jaxshard.jaxtyped
    def f(x: Float[Array, "b s d"]) -> Float[Array, "b s d"]:
        return jaxshard.constrain(x[:, :2], Act)  # s is 4 here, not 2

    with jax.set_mesh(auto_mesh), jaxshard.axis_rules(RULES):
        with pytest.raises(jaxshard.TypeCheckError, match="dimension s"):
            f(jnp.ones((8, 4, 6)))


def test_cannot_lay_out_uneven_or_missing_axes(auto_mesh):
    with jax.set_mesh(auto_mesh):
        with pytest.raises(jaxshard.ShardingError, match="splits dimension 0"):
            jaxshard.constrain(jnp.ones((6, 4)), P("dp"))
        with pytest.raises(jaxshard.ShardingError, match="names mesh axis 'fsdp'"):
            jaxshard.constrain(jnp.ones((8, 4)), P("fsdp"))


def test_annotations_that_say_nothing(auto_mesh):
    with pytest.raises(jaxshard.AnnotationError, match="states no partition spec"):
        jaxshard.constrain(jnp.ones(8), Float[Array, "n"], mesh=auto_mesh)
    with pytest.raises(jaxshard.AnnotationError, match="BY_NAME"):
        jaxshard.constrain(jnp.ones(8), jaxshard.BY_NAME, mesh=auto_mesh)
    with pytest.raises(TypeError, match="`annotation` takes"):
        jaxshard.constrain(jnp.ones(8), "dp", mesh=auto_mesh)
    with pytest.raises(ValueError, match="needs a mesh"):
        jaxshard.constrain(jnp.ones(8), P("dp"))


def test_inside_shard_map_the_annotation_is_the_global_arrays(mesh):
    """In a shard_map body the value is one block: the annotation (or spec)
    describes the global array, its manual axes are shard_map's (left as they are),
    and the axes shard_map leaves to the compiler are laid out as it says."""
    Block = Float[Array, "b d", P("dp", "tp")]
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", None)))

    def run(body, **kwargs):
        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=P("dp", None), out_specs=P("dp", None), **kwargs
        )
        with jax.set_mesh(mesh):
            return jax.jit(mapped)(x)

    for annotation in (Block, P("dp", None), Float[Array, "8 4", P("dp", None)]):
        out = run(lambda b: jaxshard.constrain(b, annotation) * 2)  # all manual
        assert (out == 2).all() and spec(out) == P("dp")
    out = run(lambda b: jaxshard.constrain(b, Block) * 2, axis_names={"dp"})
    assert (out == 2).all() and spec(out) == P("dp", "tp")  # tp laid out inside
    with pytest.raises(jaxshard.TypeCheckError, match="one block of the global"):
        run(lambda b: jaxshard.constrain(b, Float[Array, "8 5", P("dp", None)]))
    with pytest.raises(jaxshard.ShardingError, match="did you mean 'dp'"):
        run(lambda b: jaxshard.constrain(b, P("dq", None)))
    with pytest.raises(jaxshard.ShardingError, match="does not divide it evenly"):
        run(lambda b: jaxshard.constrain(b[:, :3], P("dp", "tp")), axis_names={"dp"})
