"""The same verdict for the same array and annotation on every path, one message
naming the value that failed, and no state that outlives its call or program: the
cases a differential soak against jaxtyping and JAX found
(tests/sharding/test_properties.py keeps looking for more)."""

import asyncio
import warnings

import beartype
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import hlo_ops, put
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._sharding import probes


U = P.UNCONSTRAINED


def checked(fn):
    return jaxshard.jaxtyped(typechecker=beartype.beartype)(fn)


def compiles(fn, *args, mesh=None) -> str | None:
    """The message of the ShardingError compiling `fn` raises; None if it passes."""
    try:
        if mesh is None:
            jax.jit(fn).lower(*args).compile()
        else:
            with jax.set_mesh(mesh):
                jax.jit(fn).lower(*args).compile()
    except jaxshard.ShardingError as e:
        return str(e)
    return None


# --- P.UNCONSTRAINED: any layout of its dimension -----------------------------------


def failures(error: Exception) -> str:
    """What a `jaxtyped` call's error says of its failed checks: its first line and
    its "Sharding:" section, without jaxtyping's message between them (which names
    every parameter)."""
    head, sep, rest = str(error).partition("\nType-check error whilst")
    return head + (rest.partition("\nSharding:")[2] if sep else "")


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_unconstrained_never_names_an_axis_twice(kind):
    """Filled in from the array, an unconstrained entry does not take an axis that
    the spec names elsewhere: the mismatch is that other dimension's."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(kind, kind))
    x = put((4, 8), mesh, P("a", None))
    T = Float[Array, "n m", P(U, "a")]
    assert isinstance(x, T) is False  # not DuplicateSpecError

    @checked
    def f(x: T):
        return x

    if kind == AxisType.Explicit:
        with pytest.raises(jaxshard.ShardingError) as e:
            f(x)
        sharding = failures(e.value)
        assert "P('a', None)" in sharding and "P(P.UNCONSTRAINED, 'a')" in sharding
    else:
        message = compiles(f, x)  # not JaxRuntimeError from inspect_sharding
        assert message is not None and "P(P.UNCONSTRAINED, 'a')" in message


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_unconstrained_with_a_size_one_axis(kind):
    mesh = jax.make_mesh((8, 1), ("a", "b"), axis_types=(kind, kind))
    x = put((8, 8), mesh, P(("a", "b"), None))
    T = Float[Array, "n m", P(U, "b")]
    assert NamedSharding(mesh, P("a", "b")).is_equivalent_to(x.sharding, 2)
    assert isinstance(x, T)

    @checked
    def f(x: T) -> T:
        return x * 2

    f(x)
    if kind == AxisType.Explicit:
        jax.jit(f).trace(x)
    else:
        assert compiles(f, x) is None
        assert compiles(f, x, mesh=mesh) is None


# --- shard_map blocks ---------------------------------------------------------------


def test_a_spec_longer_than_the_block_fails_in_shard_map(explicit_mesh):
    @checked
    def body(x: Float[Array, "...", P(None, "dp")]):
        return x

    x = put((8,), explicit_mesh, P("dp"))
    with pytest.raises(jaxshard.ShardingError, match="has 2 entries but the array"):
        jax.shard_map(body, mesh=explicit_mesh, in_specs=P("dp"), out_specs=P("dp"))(x)


def test_a_size_one_axis_splits_no_block():
    mesh = jax.make_mesh((8, 1), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)

    @checked
    def body(x: Float[Array, "n m", P("dp", None)]) -> Float[Array, "n m", P("dp")]:
        return x

    x = put((8, 8), mesh, P("dp", "tp"))
    assert isinstance(x, Float[Array, "n m", P("dp", None)])  # as eagerly
    specs = {"in_specs": P("dp", "tp"), "out_specs": P("dp", "tp")}
    out = jax.shard_map(body, mesh=mesh, **specs)(x)
    assert out.shape == (8, 8)


def test_an_unconstrained_entry_takes_a_split_block(explicit_mesh):
    """A block split over an axis the spec does not name fits an unconstrained
    entry, and the global shape counts that split."""

    @checked
    def body(x: Float[Array, "64 d", P(U, None)]) -> Float[Array, "64 d", P(U)]:
        return x

    x = put((64, 8), explicit_mesh, P("dp", None))
    specs = {"mesh": explicit_mesh, "in_specs": P("dp", None), "out_specs": P("dp")}
    mapped = jax.shard_map(body, **specs)
    assert mapped(x).shape == (64, 8)

    @checked
    def named(x: Float[Array, "_ d", P(None, "tp")]):
        return x

    with pytest.raises(jaxshard.ShardingError, match="replicated over them"):
        jax.shard_map(named, **specs)(x)


def test_jaxshard_shard_map_with_an_unconstrained_annotation(explicit_mesh):
    """Its in_spec lays the dimension out whole; an input laid out otherwise on
    Explicit axes is a ShardingError naming the parameter, not JAX's error."""

    @jaxshard.shard_map(mesh=explicit_mesh)
    def f(x: Float[Array, "n m", P(U, "tp")]) -> Float[Array, "n m", P(U, "tp")]:
        return x * 2

    out = f(put((8, 4), explicit_mesh, P(None, "tp")))
    assert out.sharding.is_equivalent_to(NamedSharding(explicit_mesh, P(None, "tp")), 2)
    with pytest.raises(jaxshard.ShardingError) as e:
        f(put((8, 4), explicit_mesh, P("dp", "tp")))
    assert "parameter 'x'" in str(e.value) and "jax.sharding.reshard" in str(e.value)


# --- one-device arrays inside jax.set_mesh ------------------------------------------


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_an_uncommitted_array_passes_a_spec_that_splits_nothing(kind):
    mesh = jax.make_mesh((4, 2, 1), ("dp", "tp", "one"), axis_types=(kind,) * 3)
    x = jnp.asarray(np.ones((8, 4), np.float32))  # made by jnp: uncommitted
    assert not x.committed
    with jax.set_mesh(mesh):
        assert isinstance(x, Float[Array, "b d", P()])
        assert isinstance(x, Float[Array, "b d", P("one", U)])
        reason = Float[Array, "b d", P("dp")].__instancecheck_str__(x)
        assert "uncommitted" in reason and "jax.device_put(x, NamedSharding" in reason
        missing = Float[Array, "b d", P("db")].__instancecheck_str__(x)
        assert "names mesh axis 'db'" in missing
        placed = jax.device_put(x, jax.devices()[0])  # committed to one device
        assert not isinstance(placed, Float[Array, "b d", P()])


# --- autodiff, scan and remat -------------------------------------------------------


@checked
def layer(x: Float[Array, "n m", P("dp", None)]) -> Float[Array, "n m", P("tp")]:
    return jnp.sin(x)


def scanned(x):
    return jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=3)[0]


def loss(x):
    return scanned(x).sum()


TRANSFORMED = {
    "grad of scan": jax.grad(loss),
    "vjp of scan": lambda x: jax.vjp(scanned, x)[1](x),
    "linearize of scan": lambda x: jax.linearize(scanned, x)[1](x),
    "grad of remat'ed scan": jax.grad(jax.checkpoint(loss)),
    "grad of scan of remat": jax.grad(
        lambda x: jax.lax.scan(
            lambda c, _: (jax.checkpoint(layer)(c), None), x, None, length=2
        )[0].sum()
    ),
    "grad of fori_loop": jax.grad(
        lambda x: jax.lax.fori_loop(0, 2, lambda i, c: layer(c), x).sum()
    ),
    "vmap of grad of scan": jax.vmap(jax.grad(loss)),
    "grad of nested jit in scan": jax.grad(
        lambda x: jax.lax.scan(
            lambda c, _: (jax.jit(layer)(c), None), x, None, length=2
        )[0].sum()
    ),
}


@pytest.mark.parametrize("name", list(TRANSFORMED))
@pytest.mark.parametrize("in_context", [False, True])
def test_contracts_in_differentiated_bodies_are_checked(name, in_context, auto_mesh):
    """Under grad (linearize, vjp, remat policies) a scanned body's checks stay in
    the program, as in the forward pass."""
    fn = TRANSFORMED[name]
    shape = (2, 8, 8) if name.startswith("vmap") else (8, 8)
    x = put(shape, auto_mesh, P(*[None] * (len(shape) - 2), "dp", None))
    message = compiles(fn, x, mesh=auto_mesh if in_context else None)
    assert message is not None, name
    assert "layer" in message and "the return value" in message


def test_explicit_axes_check_the_same_bodies(explicit_mesh):
    for name, fn in TRANSFORMED.items():
        shape = (2, 8, 8) if name.startswith("vmap") else (8, 8)
        x = put(shape, explicit_mesh, P(*[None] * (len(shape) - 2), "dp", None))
        with pytest.raises(jaxshard.ShardingError, match="the return value"):
            jax.jit(fn).trace(x)


def test_verify_keeps_every_row_of_a_differentiated_scan(auto_mesh):
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    forward = jaxshard.verify(
        scanned, mesh=auto_mesh, values={"x": x}, raise_on_error=False
    )
    backward = jaxshard.verify(
        jax.grad(loss), mesh=auto_mesh, values={"x": x}, raise_on_error=False
    )
    assert len(backward.rows) == len(forward.rows) > 0
    assert [(r.name, r.ok) for r in backward.rows] == [
        (r.name, r.ok) for r in forward.rows
    ]


def test_probes_under_set_mesh_add_nothing_to_the_program(auto_mesh):
    """Under `jax.set_mesh` the probe needs no device assignment from JAX; like
    the other, it leaves no operation and no effect behind."""

    def plain(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]

    x = put((8, 8), auto_mesh, P("tp", None))  # as `layer` says its output is

    @checked
    def good(x: Float[Array, "n m", P("tp", None)]) -> Float[Array, "n m", P("tp")]:
        return jnp.sin(x)

    def checked_scan(x):
        return jax.lax.scan(lambda c, _: (good(c), None), x, None, length=3)[0]

    with jax.set_mesh(auto_mesh):
        for f, g in [(plain, checked_scan)]:
            ours = jax.jit(jax.grad(lambda x: g(x).sum())).lower(x).compile()
            theirs = jax.jit(jax.grad(lambda x: f(x).sum())).lower(x).compile()
            assert hlo_ops(ours.as_text()) == hlo_ops(theirs.as_text())
            assert not jax.make_jaxpr(jax.grad(lambda x: g(x).sum()))(x).effects


def test_arrays_left_on_another_axis_type_do_not_break_a_checked_program():
    """An array on an Explicit mesh next to arrays on an Auto mesh of the same
    devices (torchax's PRNG key after an Explicit call, say): JAX takes the program,
    with or without jaxshard's annotations."""
    explicit = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    auto = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    key = put((2,), explicit, P())

    @checked
    def f(x: Float[Array, "n m", P("dp", None)], k: Float[Array, "2"]):
        return x * 2, k

    with jax.set_mesh(auto):
        jax.jit(f)(put((8, 4), auto, P("dp", None)), key)
        with pytest.raises(jaxshard.ShardingError):
            jax.jit(f)(put((8, 4), auto, P("tp", None)), key)


# --- messages name the value that failed --------------------------------------------


@pytest.mark.parametrize("kind", ["explicit", "auto", "eager"])
def test_the_message_names_the_value_that_failed(kind, explicit_mesh, auto_mesh):
    mesh = auto_mesh if kind == "auto" else explicit_mesh

    @checked
    def passthrough(
        x: Float[Array, "n m", P("dp", None)],
    ) -> Float[Array, "n m", P("tp")]:
        return x

    @checked
    def two(x: Float[Array, "n m", P("dp", None)], y: Float[Array, "n m", P("tp")]):
        return x

    a = put((8, 4), mesh, P("dp", None))
    for fn, args, name in [(passthrough, (a,), "the return value"), (two, (a, a), "y")]:
        if kind == "auto":
            message = compiles(fn, *args)
        else:
            with pytest.raises(jaxshard.ShardingError) as e:
                fn(*args) if kind == "eager" else jax.jit(fn).trace(*args)
            message = failures(e.value)
        assert message is not None
        wanted = name if name.startswith("the") else f"parameter {name!r}"
        assert wanted in message, message
        assert "parameter 'x'" not in message, message


# --- nothing outlives its program ---------------------------------------------------


@checked
def numbered(x: Float[Array, "n", P("dp")]) -> Float[Array, "n", P("dp")]:
    return x + 1


def test_call_numbers_count_the_calls_of_one_program(auto_mesh):
    for n in (8, 16, 24):  # three programs whose checks pass
        jax.jit(numbered)(put((n,), auto_mesh, P("dp")))
        assert not probes._checked  # nothing left of them
    message = compiles(numbered, put((32,), auto_mesh, P("tp")))
    assert message is not None
    assert "numbered" in message and " of " not in message.split("\n")[1]
    assert not probes._checked and not probes._pending


# --- annotations are checked when they are made -------------------------------------


@pytest.mark.parametrize("text", ["batch d)", "(b", "b a+", "[b/dp] d)"])
def test_a_malformed_shape_string_is_refused_when_built(text):
    with pytest.raises(jaxtyping.AnnotationError) as e:
        Float[Array, text]
    assert "Cannot parse the shape" in str(e.value) and repr(text) in str(e.value)
    Float[Array, "batch-1 2*d {x}"]  # expressions, f-string fields: fine


def test_an_unannotated_function_warns_in_one_line():
    """A function with no annotations (beartype leaves one as it is, so under
    jaxtyping's old `@jaxtyped @beartype` syntax too): one line saying there is
    nothing to check, not jaxtyping's warning about a syntax the user did not
    write; the function is wrapped as jaxtyping wraps it and checks nothing."""

    async def gen():
        return 1

    for typechecker in (beartype.beartype, lambda fn: fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = jaxshard.jaxtyped(typechecker(gen))
        [warning] = caught
        assert str(warning.message) == (
            "jaxshard.jaxtyped: test_an_unannotated_function_warns_in_one_line."
            "<locals>.gen has no annotations, so there is nothing to check; annotate "
            "its parameters or return value, or leave the decorator out."
        )
        assert warning.filename == __file__  # the decorator's line, not jaxshard's
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert asyncio.run(f()) == 1


@pytest.mark.parametrize("decorator", [jaxshard.jaxtyped, jaxtyping.jaxtyped])
def test_a_probe_evaluated_op_by_op_raises_at_once(decorator, auto_mesh):
    """A remat'ed function called outside `jit` evaluates its program op by op,
    probes included: a violation is raised by that call, and nothing is left over
    for the next compile to report."""

    @decorator(typechecker=beartype.beartype)
    def f(x: Float[Array, "..."]) -> Float[Array, "a b", P(None, "tp")]:
        return x

    x = put((16, 16), auto_mesh, P("dp", None))
    with jax.set_mesh(auto_mesh):
        with pytest.raises(jaxshard.ShardingError, match="op by op") as e:
            jax.checkpoint(f)(x)
        assert "the return value" in str(e.value) and "this array is sharded" in str(
            e.value
        )
        assert not probes._pending and not probes._checked
        jax.jit(lambda x: x * 2)(x)  # compiles, and reports nothing


def test_vmap_outside_jit_checks_in_the_call(auto_mesh):
    """`vmap` outside `jit` evaluates a probe as it is bound: the check itself
    fails, with the Sharding section, and `isinstance` says False."""
    T = Float[Array, "d", P()]

    @checked
    def f(x: T):
        return x * 2

    x = put((2, 8), auto_mesh, P(None, "dp"))
    with jax.set_mesh(auto_mesh):
        with pytest.raises(jaxshard.ShardingError) as e:
            jax.vmap(f)(x)
        assert jax.vmap(lambda r: jnp.asarray(isinstance(r, T)))(x).tolist() == [
            False,
            False,
        ]
    sharding = failures(e.value)
    assert "parameter 'x'" in sharding and "is sharded as P('dp')" in sharding
