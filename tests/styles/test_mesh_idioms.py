"""Older and alternative mesh idioms, and Explicit-axis code, as public JAX code
writes them: `with mesh:`, `jax.set_mesh`, `Mesh(create_device_mesh(...), names)`,
`jax.jit(in_shardings=..., out_shardings=...)`, arrays from
`make_array_from_callback`, tuple entries, `P.UNCONSTRAINED`, uneven shapes; a
`lax.scan` over stacked layer weights, `reshard`, `auto_axes`/`explicit_axes`,
`vmap`, remat and `grad` with value checks; a mesh of Auto and Explicit axes. Each
contract that holds passes, and each wrong one is reported naming the function and
the parameter."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax import Array
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


X = Float[Array, "b d", P("dp", None)]
W = Float[Array, "d f", P(None, "tp")]
STACKED = Float[Array, "layers d f", P(None, None, "tp")]


def _mesh(kind: str = "auto", shape=(4, 2), names=("dp", "tp")) -> Mesh:
    """A mesh as older code builds it: `Mesh(create_device_mesh(...), names)`."""
    types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[kind]
    devices = mesh_utils.create_device_mesh(shape)
    return Mesh(devices, names, axis_types=(types,) * len(names))


@jaxshard.jaxtyped(typechecker=beartype)
def scale(x: X) -> X:
    return x * 2


@jaxshard.jaxtyped(typechecker=beartype)
def scale_tp(
    x: Float[Array, "b d", P(None, "tp")],
) -> Float[Array, "b d", P(None, "tp")]:
    return x * 2


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _legacy(mesh):
    """`with mesh:`, which every supported JAX deprecates but still takes."""
    warnings.simplefilter("ignore", DeprecationWarning)
    return mesh


# --- older mesh idioms --------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_with_mesh_context_eager_and_jit():
    mesh = _mesh()
    x = _put(jnp.ones((8, 4)), mesh, P("dp", None))
    with _legacy(mesh):
        assert scale(x).sharding.spec == P("dp", None)
        assert jax.jit(scale)(x).sharding.spec == P("dp", None)
        # Uncommitted, under the legacy context: a split spec fails, eagerly.
        with pytest.raises(jaxshard.ShardingError, match=r"scale, parameter 'x'"):
            scale(jnp.ones((8, 4)))
        with pytest.raises(jaxshard.ShardingError, match=r"scale_tp, parameter 'x'"):
            jax.jit(scale_tp)(x)


def test_set_mesh_device_put_with_a_partition_spec():
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), P("dp", None))
        assert jax.jit(scale)(x).sharding.spec == P("dp", None)
        with pytest.raises(jaxshard.ShardingError, match=r"scale_tp, parameter 'x'"):
            jax.jit(scale_tp)(x)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_jit_with_sharding_trees_and_none_entries(kind):
    mesh = _mesh(kind)
    sx, sw = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P(None, "tp"))

    @jaxshard.jaxtyped(typechecker=beartype)
    def step(params: dict[str, W], x: X) -> Float[Array, "b f", P("dp", "tp")]:
        return _matmul(x, params["w"], NamedSharding(mesh, P("dp", "tp")), kind)

    x, w = (
        _put(jnp.ones((8, 4)), mesh, P("dp", None)),
        _put(jnp.ones((4, 4)), mesh, P(None, "tp")),
    )
    out = NamedSharding(mesh, P("dp", "tp"))
    for shardings in [({"w": sw}, sx), ({"w": None}, None), None]:
        kwargs = {} if shardings is None else {"in_shardings": shardings}
        jitted = jax.jit(step, **kwargs, out_shardings=out if shardings else None)
        assert jitted({"w": w}, x).sharding.spec == P("dp", "tp")
    # Host data, which jit places as its in_shardings say: here wrongly.
    wrong = ({"w": NamedSharding(mesh, P("tp", None))}, sx)
    host = {"w": np.ones((4, 4), np.float32)}, np.ones((8, 4), np.float32)
    with pytest.raises(
        jaxshard.ShardingError, match=r"step, leaf \"params\['w'\]\", P\('tp', None\)"
    ):
        jax.jit(step, in_shardings=wrong)(*host)


def _matmul(x, w, spec, kind):
    if kind == "explicit":
        return jnp.einsum("bd,df->bf", x, w, out_sharding=spec)
    return jnp.einsum("bd,df->bf", x, w)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_arrays_made_from_host_data(kind):
    mesh = _mesh(kind)
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    sharding = NamedSharding(mesh, P("dp", None))
    made = [
        jax.make_array_from_callback(host.shape, sharding, lambda index: host[index]),
        jax.make_array_from_process_local_data(sharding, host),
    ]
    for x in made:
        assert scale(x).sharding.spec == P("dp", None)
        assert jax.jit(scale)(x).sharding.spec == P("dp", None)
    other = NamedSharding(mesh, P(None, "tp"))
    x = jax.make_array_from_callback(host.shape, other, lambda index: host[index])
    with pytest.raises(jaxshard.ShardingError, match=r"scale, parameter 'x'"):
        scale(x)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_tuple_entries_in_their_order(kind):
    mesh = _mesh(kind, (2, 2, 2), ("dp", "fsdp", "tp"))
    both = Float[Array, "b d", P(("dp", "fsdp"), None)]

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: both) -> both:
        return x + 1

    x = _put(jnp.ones((8, 4)), mesh, P(("dp", "fsdp"), None))
    assert f(x).sharding.spec == P(("dp", "fsdp"), None)
    assert jax.jit(f)(x).sharding.spec == P(("dp", "fsdp"), None)
    swapped = _put(jnp.ones((8, 4)), mesh, P(("fsdp", "dp"), None))
    with pytest.raises(jaxshard.ShardingError, match=r"f, parameter 'x'"):
        f(swapped)
    with pytest.raises(jaxshard.ShardingError, match=r"f, parameter 'x'"):
        jax.jit(f)(swapped)


def test_unconstrained_entries():
    mesh = _mesh()
    loose = Float[Array, "b d", P("dp", P.UNCONSTRAINED)]

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: loose) -> loose:
        return x * 2

    for spec in [P("dp", None), P("dp", "tp")]:
        assert jax.jit(f)(_put(jnp.ones((8, 4)), mesh, spec)).sharding.spec == spec
    with pytest.raises(jaxshard.ShardingError, match=r"f, parameter 'x'"):
        jax.jit(f)(_put(jnp.ones((8, 4)), mesh, P(None, "tp")))


def test_uneven_shapes_inside_a_program():
    """6 rows over a dp of 4: XLA pads, and the layout is still P('dp', None)."""
    mesh = _mesh()

    def head(x: Float[Array, "8 d", P("dp", None)]):
        return scale(x[:6])

    def head_tp(x: Float[Array, "8 d", P("dp", None)]):
        return scale_tp(x[:6])

    report = jaxshard.verify(head, mesh=mesh, dims={"d": 4})
    assert report.ok
    with pytest.raises(jaxshard.ShardingError, match=r"scale_tp, parameter 'x'"):
        jaxshard.verify(head_tp, mesh=mesh, dims={"d": 4})


# --- Explicit-axis code -------------------------------------------------------------


def _layer(kind):
    @jaxshard.jaxtyped(typechecker=beartype)
    def layer(x: X, w: W) -> X:
        if kind == "explicit":
            h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("dp", "tp"))
            h = jax.sharding.reshard(h, P("dp", None))
        else:
            h = jax.lax.with_sharding_constraint(x @ w, P("dp", None))
        return jnp.tanh(h)

    return layer


def _stack(kind, remat=False):
    layer = _layer(kind)
    if remat:
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        layer = jax.checkpoint(layer, policy=policy)

    @jaxshard.jaxtyped(typechecker=beartype)
    def stack(x: X, ws: STACKED) -> X:
        return jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0]

    return stack


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("remat", [False, True])
def test_scan_over_stacked_layers_with_grad_and_value_checks(kind, remat):
    mesh = _mesh(kind)
    stack = _stack(kind, remat)

    def loss(ws, x):
        return stack(x, ws).sum()

    @jaxshard.checked
    @jax.jit
    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        jaxshard.check(jnp.isfinite(value), "loss is {value}", value=value)
        jaxshard.check_finite(grads, name="grads")
        return ws - 0.1 * grads

    with jax.set_mesh(mesh):
        x = _put(jnp.ones((8, 4)), mesh, P("dp", None))
        ws = _put(jnp.ones((3, 4, 4)), mesh, P(None, None, "tp"))
        assert step(ws, x).sharding.spec == P(None, None, "tp")
        jaxshard.flush_checks()
        bad = _put(jnp.full((3, 4, 4), jnp.inf), mesh, P(None, None, "tp"))
        with pytest.raises(jaxshard.CheckError, match="grads"):
            step(bad, x)
            jaxshard.flush_checks()
        wrong = _put(jnp.ones((3, 4, 4)), mesh, P(None, "tp", None))
        with pytest.raises(jaxshard.ShardingError, match=r"stack, parameter 'ws'"):
            step(wrong, x)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_vmap_over_an_annotated_function(kind):
    mesh = _mesh(kind)

    @jaxshard.jaxtyped(typechecker=beartype)
    def row(r: Float[Array, " d", P(None)], w: W) -> Float[Array, " f", P("tp")]:
        return _matmul(r[None], w, NamedSharding(mesh, P(None, "tp")), kind)[0]

    @jaxshard.jaxtyped(typechecker=beartype)
    def row_dp(r: Float[Array, " d", P("dp")], w: W) -> Float[Array, " f", P("tp")]:
        return _matmul(r[None], w, NamedSharding(mesh, P(None, "tp")), kind)[0]

    x = _put(jnp.ones((8, 4)), mesh, P("dp", None))
    w = _put(jnp.ones((4, 4)), mesh, P(None, "tp"))
    out = jax.jit(jax.vmap(row, in_axes=(0, None), spmd_axis_name="dp"))(x, w)
    assert out.sharding.spec == P("dp", "tp")
    with pytest.raises(jaxshard.ShardingError, match=r"row_dp, parameter 'r'"):
        jax.jit(jax.vmap(row_dp, in_axes=(0, None), spmd_axis_name="dp"))(x, w)


def test_auto_axes_and_explicit_axes():
    explicit, auto = _mesh("explicit"), _mesh("auto")
    x = _put(jnp.ones((8, 4)), explicit, P("dp", None))
    inside = jax.sharding.auto_axes(scale, out_sharding=P("dp", None))
    inside_tp = jax.sharding.auto_axes(scale_tp, out_sharding=P("dp", None))
    with jax.set_mesh(explicit):
        assert jax.jit(inside)(x).sharding.spec == P("dp", None)
        with pytest.raises(jaxshard.ShardingError, match=r"scale_tp, parameter 'x'"):
            jax.jit(inside_tp)(x)
    y = _put(jnp.ones((8, 4)), auto, P("dp", None))
    inside = jax.sharding.explicit_axes(scale, in_sharding=P("dp", None))
    inside_tp = jax.sharding.explicit_axes(scale_tp, in_sharding=P("dp", None))
    with jax.set_mesh(auto):
        assert jax.jit(inside)(y).sharding.spec == P("dp", None)
        with pytest.raises(jaxshard.ShardingError, match=r"scale_tp, parameter 'x'"):
            jax.jit(inside_tp)(y)


# --- a mesh of Auto and Explicit axes -----------------------------------------------


def test_mixed_mesh():
    mesh = jax.make_mesh(
        (4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: X, w: W) -> Float[Array, "b f", P("dp", "tp")]:
        return jnp.einsum("bd,df->bf", x, w)

    @jaxshard.jaxtyped(typechecker=beartype)
    def f_rows(x: X, w: W) -> X:
        return jnp.einsum("bd,df->bf", x, w)

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), P("dp", None))
        w = jax.device_put(jnp.ones((4, 4)), P(None, "tp"))
        assert f(x, w).sharding.spec == P("dp", "tp")
        assert jax.jit(f)(x, w).sharding.spec == P("dp", "tp")
        grad = jax.jit(jax.grad(lambda w: jnp.tanh(f(x, w)).sum()))(w)
        assert grad.sharding.spec == P(None, "tp")
        with pytest.raises(jaxshard.ShardingError, match=r"f_rows, the return value"):
            jax.jit(f_rows)(x, w)
        w_rows = jax.device_put(jnp.ones((4, 4)), P("tp", None))
        with pytest.raises(jaxshard.ShardingError, match=r"f, parameter 'w'"):
            f(x, w_rows)
        with pytest.raises(jaxshard.ShardingError, match=r"f, parameter 'w'"):
            jax.jit(f)(x, w_rows)


def test_a_carry_laid_out_wrong_is_not_said_to_be_passed_in():
    """A scan's carry that XLA lays out wrong (from the slices of a misplaced stacked
    weight) is no input of the program: the message does not send the reader to what
    is passed in, which is laid out as annotated."""
    mesh = _mesh()
    layer = _layer("auto")

    def loss(ws, x):  # unannotated: the carry is `layer`'s first checked value
        return jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0].sum()

    x = _put(jnp.ones((8, 4)), mesh, P("dp", None))
    wrong = _put(jnp.ones((3, 4, 4)), mesh, P(None, "tp", None))
    with jax.set_mesh(mesh), pytest.raises(jaxshard.ShardingError) as caught:
        jax.jit(jax.grad(loss))(wrong, x)
    message = str(caught.value)
    assert "layer, parameter 'x', P('dp', 'tp')" in message.splitlines()[0]
    assert "given to the program laid out so" not in message
    assert "It was made inside the program" in message
    assert "layer, parameter 'w'" in message
    # An input passed in laid out wrong is still said to be.
    with pytest.raises(
        jaxshard.ShardingError, match="given to the program laid out so"
    ):
        jax.jit(lambda x: scale_tp(scale_tp(x)))(x)


@pytest.mark.parametrize(
    "types",
    [
        (AxisType.Explicit,) * 2,
        (AxisType.Auto,) * 2,
        (AxisType.Explicit, AxisType.Auto),
    ],
    ids=["explicit", "auto", "mixed"],
)
def test_jaxshard_shard_map_partly_manual(types):
    """`axis_names={"dp"}`: the annotations describe the global array over every
    axis; jax.shard_map is given their specs over the manual axes alone (it refuses
    one naming 'tp')."""
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=types)
    both = Float[Array, "b d", P("dp", "tp")]

    @jaxshard.jaxtyped(typechecker=beartype)
    def body(x: both) -> both:
        return x * 2

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), P("dp", "tp"))
        mapped = jaxshard.shard_map(body, axis_names={"dp"})
        out = jax.jit(mapped)(x)
        assert out.sharding.spec == P("dp", "tp")
        np.testing.assert_array_equal(out, 2 * np.ones((8, 4)))
        if types[1] == AxisType.Explicit:  # tp is checked from the block's type
            rows = jaxshard.shard_map(scale, axis_names={"dp"})
            with pytest.raises(jaxshard.ShardingError, match=r"scale\), parameter 'x'"):
                jax.jit(rows)(x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_placing_and_constraining_under_the_legacy_context(kind):
    """`jaxshard.device_put`, `shardings_of`, `shardings` and `constrain` read the
    mesh of `with mesh:` as they read `jax.set_mesh`'s."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: W
        b: Float[Array, " f", P("tp")]

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: X) -> X:
        return jaxshard.constrain(x * 2, X)

    mesh = _mesh(kind)
    with _legacy(mesh):
        params = jaxshard.device_put(Params(jnp.ones((4, 4)), jnp.ones(4)))
        assert params.w.sharding == NamedSharding(mesh, P(None, "tp"))
        assert jaxshard.shardings_of(params).b == NamedSharding(mesh, P("tp"))
        ins, out = jaxshard.shardings(f)
        assert ins == (NamedSharding(mesh, P("dp", None)),) and out == ins[0]
        x = _put(jnp.ones((8, 4)), mesh, P("dp", None))
        assert jax.jit(f)(x).sharding.spec == P("dp", None)
        jaxshard.check_tree(params)
        with pytest.raises(jaxshard.ShardingError, match=r"Params\.w"):
            jaxshard.check_tree(
                Params(_put(jnp.ones((4, 4)), mesh, P("tp", None)), params.b)
            )


@pytest.mark.parametrize(
    "loop", ["scan_unroll", "scan_reverse", "fori_loop", "while_loop", "cond", "map"]
)
def test_value_and_sharding_checks_in_control_flow_on_explicit_axes(loop):
    mesh = _mesh("explicit")

    @jaxshard.jaxtyped(typechecker=beartype)
    def layer(x: X, w: W) -> X:
        h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("dp", None))
        jaxshard.check(jnp.all(jnp.abs(h) < 1e3), "big {m}", m=jnp.abs(h).max())
        return jnp.tanh(h)

    def body(c, w):
        return layer(c, w), None

    programs = {
        "scan_unroll": lambda ws, x: jax.lax.scan(body, x, ws, unroll=2)[0],
        "scan_reverse": lambda ws, x: jax.lax.scan(body, x, ws, reverse=True)[0],
        "fori_loop": lambda ws, x: jax.lax.fori_loop(
            0, 3, lambda i, c: layer(c, ws[i]), x
        ),
        "while_loop": lambda ws, x: jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, layer(c[1], ws[c[0]])), (0, x)
        )[1],
        "cond": lambda ws, x: jax.lax.cond(
            x.sum() > 0, lambda: layer(x, ws[0]), lambda: x
        ),
        "map": lambda ws, x: jax.lax.map(lambda w: layer(x, w), ws).sum(0),
    }
    step = jaxshard.checked(jax.jit(programs[loop]))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), P("dp", None))
        ws = jax.device_put(jnp.ones((3, 4, 4)), P(None, None, "tp"))
        assert step(ws, x).sharding.spec == P("dp", None)
        jaxshard.flush_checks()
        with pytest.raises(jaxshard.CheckError, match="big 40000"):
            step(ws * 1e4, x)
            jaxshard.flush_checks()
        wrong = jax.device_put(jnp.ones((3, 4, 4)), P(None, "tp", None))
        with pytest.raises(jaxshard.ShardingError, match=r"layer, parameter 'w'"):
            step(wrong, x)
