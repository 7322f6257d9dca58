"""Inside `jax.jit`: at trace time on Explicit meshes, at compile time on Auto ones."""

import re

import beartype
import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import hlo_ops, layer, put
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float


def test_explicit_checked_at_trace_time(typechecker, jaxtyped, explicit_mesh):
    f = layer(jaxtyped, typechecker)
    x = put((8, 4), explicit_mesh, P("dp", None))
    w = put((4, 6), explicit_mesh, P(None, "tp"))
    with jax.set_mesh(explicit_mesh):
        assert jax.jit(f)(x, w).shape == (8, 6)
        bad = put((8, 4), explicit_mesh, P(None, "tp"))
        with pytest.raises(jaxtyping.TypeCheckError):
            jax.jit(f).trace(bad, w)  # tracing alone finds it
    # no mesh in context: the mesh comes from the arrays
    assert jax.jit(f)(x, w).shape == (8, 6)
    with pytest.raises(jaxtyping.TypeCheckError):
        jax.jit(f)(bad, w)


def test_explicit_message(explicit_mesh):
    f = layer()
    w = put((4, 6), explicit_mesh, P(None, "tp"))
    with pytest.raises(jaxshard.ShardingError) as info:
        jax.jit(f)(put((8, 4), explicit_mesh, P(None, "tp")), w)
    msg = str(info.value)
    for fragment in [
        "parameter 'x'",
        "P('dp', None)",
        "sharded as P(None, 'tp')",
        "{'dp': 4, 'tp': 2}",
        "float32[8,4@tp]",
    ]:
        assert fragment in msg, fragment


def test_explicit_intermediate_return(explicit_mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def g(x: Float[Array, "b d", P("dp")]) -> Float[Array, "d b", P("dp")]:
        return x.T  # explicit sharding follows the transpose: P(None, 'dp')

    with pytest.raises(jaxshard.ShardingError, match="the return value"):
        jax.jit(g)(put((8, 4), explicit_mesh, P("dp")))


def test_auto_checked_at_compile_time(typechecker, jaxtyped, auto_mesh):
    f = layer(jaxtyped, typechecker)
    x = put((8, 4), auto_mesh, P("dp", None))
    w = put((4, 6), auto_mesh, P(None, "tp"))
    assert jax.jit(f)(x, w).shape == (8, 6)
    bad = put((8, 4), auto_mesh, P(None, "tp"))
    traced = jax.jit(f).trace(bad, w)  # tracing can't know yet
    lowered = traced.lower()
    with pytest.raises(jaxshard.ShardingError) as info:
        lowered.compile()
    assert "Error calling inspect_sharding" not in str(info.value)
    with pytest.raises(jaxshard.ShardingError):
        jax.jit(f)(bad, w)


def test_auto_message_lists_every_violation(auto_mesh):
    f = layer()
    x = put((8, 4), auto_mesh, P(None, "tp"))
    w = put((4, 6), auto_mesh, P("dp", None))
    with pytest.raises(jaxshard.ShardingError) as info:
        jax.jit(f)(x, w)
    msg = str(info.value)
    assert "violated in jit(f)" in msg
    assert "parameter 'x'" in msg and "parameter 'w'" in msg
    assert "the return value" in msg
    details = msg.split("\n", 1)[1]  # (the first line names the likely cause)
    assert details.count("parameter 'x'") == 1  # reported once though checked twice
    for fragment in [
        "helpers.layer.<locals>.f",
        "P('dp', None)",
        "P(None, 'tp')",
        "{'dp': 4, 'tp': 2}",
        "float32[8,4]",
        "after XLA's sharding",
    ]:
        assert fragment in msg, fragment
    # The failed compile was not cached: the next call checks again.
    with pytest.raises(jaxshard.ShardingError):
        jax.jit(f)(x, w)


def test_auto_with_set_mesh_and_in_shardings(auto_mesh):
    f = layer()
    x = jnp.ones((8, 4))
    w = jnp.ones((4, 6))
    with jax.set_mesh(auto_mesh):
        good = jax.jit(f, in_shardings=(P("dp", None), P(None, "tp")))
        assert good(x, w).shape == (8, 6)
        bad = jax.jit(f, in_shardings=(P("tp", None), P(None, "tp")))
        with pytest.raises(jaxshard.ShardingError, match="parameter 'x'"):
            bad(x, w)


def test_auto_propagated_intermediate(auto_mesh):
    """XLA's propagation decides the sharding of an unconstrained intermediate."""

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def inner(
        h: Float[Array, "b h", P("dp", "tp")],
    ) -> Float[Array, "b h", P("dp", "tp")]:
        return jnp.tanh(h)

    def step(x, w):
        return inner(x @ w).sum()

    x = put((8, 4), auto_mesh, P("dp", None))
    w = put((4, 6), auto_mesh, P(None, "tp"))
    jax.jit(step)(x, w)
    with pytest.raises(jaxshard.ShardingError, match="parameter 'h'"):
        jax.jit(step)(x, put((4, 6), auto_mesh, P(None, None)))


def test_checks_add_no_operations_and_keep_the_fast_path(auto_mesh):
    f = layer()

    def plain(x, w):
        return x @ w

    x = put((8, 4), auto_mesh, P("dp", None))
    w = put((4, 6), auto_mesh, P(None, "tp"))
    checked_hlo = jax.jit(f).lower(x, w).compile().as_text()
    plain_hlo = jax.jit(plain).lower(x, w).compile().as_text()
    assert hlo_ops(checked_hlo) == hlo_ops(plain_hlo)
    assert "InspectSharding" not in checked_hlo
    # No effect in the jaxpr, so jit's C++ fast dispatch stays on.
    assert not jax.make_jaxpr(f)(x, w).effects


def test_sharding_off_leaves_no_probe(auto_mesh):
    f = layer()
    x = put((8, 4), auto_mesh, P(None, "tp"))
    w = put((4, 6), auto_mesh, P(None, "tp"))
    with jaxshard.config(sharding="off"):
        jaxpr = jax.make_jaxpr(f)(x, w)
        assert jax.jit(f)(x, w).shape == (8, 6)
    assert "jaxshard_sharding_probe" not in str(jaxpr)


# --- transformations ----------------------------------------------------------------


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def row_fn(r: Float[Array, "d", P("tp")]) -> Float[Array, "d", P("tp")]:
    return r * 2


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_vmap_removes_the_mapped_dimension(kind, explicit_mesh, auto_mesh):
    mesh = explicit_mesh if kind == "explicit" else auto_mesh
    x = put((8, 4), mesh, P("dp", "tp"))
    assert jax.jit(jax.vmap(row_fn))(x).shape == (8, 4)
    bad = put((8, 4), mesh, P("tp", "dp"))
    with pytest.raises(jaxtyping.TypeCheckError):
        jax.jit(jax.vmap(row_fn))(bad)
    # mapped over the second dimension: each slice is a column, sharded over dp
    with pytest.raises(jaxtyping.TypeCheckError):
        jax.jit(jax.vmap(row_fn, in_axes=1, out_axes=1))(x)
    y = put((4, 8), mesh, P("tp", "dp"))
    assert jax.jit(jax.vmap(row_fn, in_axes=1, out_axes=1))(y).shape == (4, 8)


def test_nested_vmap_auto(auto_mesh):
    x = put((2, 8, 4), auto_mesh, P(None, "dp", "tp"))
    assert jax.jit(jax.vmap(jax.vmap(row_fn)))(x).shape == (2, 8, 4)
    # mapped over dims 2 then 1: each example is z[:, j, i], sharded like z's dim 0
    nested = jax.jit(jax.vmap(jax.vmap(row_fn, in_axes=1), in_axes=2))
    assert nested(put((4, 2, 8), auto_mesh, P("tp", None, "dp"))).shape == (8, 2, 4)
    with pytest.raises(jaxshard.ShardingError):
        nested(put((4, 2, 8), auto_mesh, P("dp", None, "tp")))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_grad_scan_while_cond_nested_jit_remat(kind, explicit_mesh, auto_mesh):
    """Checks run inside every transformation: no crash, no false alarm, and a
    mis-sharded value is still caught."""
    mesh = explicit_mesh if kind == "explicit" else auto_mesh

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def g(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp", None)]:
        return jnp.sin(x)

    programs = {
        "grad": lambda x: jax.grad(lambda x: g(x).sum())(x),
        "nested jit": lambda x: jax.jit(g)(x) + 1,
        "remat": lambda x: jax.checkpoint(g)(x),
        "grad remat": lambda x: jax.grad(lambda x: jax.checkpoint(g)(x).sum())(x),
        "cond": lambda x: jax.lax.cond(x.sum() > 0, g, lambda x: x, x),
        "while": lambda x: jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (g(c[0]), c[1] + 1), (x, 0)
        )[0],
        "fori": lambda x: jax.lax.fori_loop(0, 3, lambda i, x: g(x), x),
        "scan carry": lambda x: jax.lax.scan(lambda c, _: (g(c), None), x, None, 3)[0],
    }
    good = put((8, 4), mesh, P("dp", None))
    bad = put((8, 4), mesh, P(None, "tp"))
    for name, program in programs.items():
        out = jax.jit(program)(good)
        assert out.shape == (8, 4), name
        if name in ("while", "fori", "scan carry", "cond") and kind == "explicit":
            # loop carries must keep their sharding; jax rejects a mismatch itself
            continue
        with pytest.raises(jaxtyping.TypeCheckError):
            jax.jit(program)(bad)


def test_scan_body_sees_one_slice(auto_mesh):
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def body(c, r: Float[Array, "d", P()]):
        return c + r.sum(), r

    xs = put((8, 4), auto_mesh, P(None, None))
    jax.jit(lambda xs: jax.lax.scan(body, 0.0, xs))(xs)


def test_legacy_with_mesh(auto_mesh):
    import warnings

    f = layer()
    x = jnp.ones((8, 4))
    w = jnp.ones((4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with auto_mesh:
            good = jax.jit(
                f,
                in_shardings=(
                    NamedSharding(auto_mesh, P("dp", None)),
                    NamedSharding(auto_mesh, P(None, "tp")),
                ),
            )
            assert good(x, w).shape == (8, 6)


def test_single_device_jit_passes_any_spec():
    f = layer()
    assert jax.jit(f)(jnp.ones((8, 4)), jnp.ones((4, 6))).shape == (8, 6)


def test_mixed_axis_types():
    mesh = jax.make_mesh(
        (4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    f = layer()
    x = put((8, 4), mesh, P("dp", None))
    w = put((4, 6), mesh, P(None, "tp"))
    with jax.set_mesh(mesh):
        assert jax.jit(f)(x, w).shape == (8, 6)
        with pytest.raises(jaxshard.ShardingError):
            jax.jit(f)(x, put((4, 6), mesh, P("dp", None)))


def test_checkify_does_not_break_the_probe(auto_mesh):
    """`inspect_array_sharding` breaks under checkify (jax#26889), our probe doesn't."""
    from jax.experimental import checkify

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def f(x: Float[Array, "b d", P("dp")]):
        checkify.check(jnp.all(x > 0), "x must be positive")
        return x * 2

    err, _ = jax.jit(checkify.checkify(f))(put((8, 4), auto_mesh, P("dp")))
    assert err.get() is None
    with pytest.raises(jaxshard.ShardingError):
        jax.jit(checkify.checkify(f))(put((8, 4), auto_mesh, P("tp")))


def test_compile_time_errors_go_to_the_thread_that_compiled(auto_mesh):
    import threading

    outcomes = {}
    barrier = threading.Barrier(2)

    def work(spec, key):
        @jaxshard.jaxtyped(typechecker=beartype.beartype)
        def f(x: Float[Array, "b d", P("dp")]):
            return jnp.sin(x) * 2

        x = put((8, 4), auto_mesh, spec)
        barrier.wait()
        try:
            for _ in range(5):
                jax.jit(lambda x: f(x) + 1).lower(x).compile()
            outcomes[key] = "passed"
        except jaxshard.ShardingError:
            outcomes[key] = "raised"

    threads = [
        threading.Thread(target=work, args=(P("dp"), "good")),
        threading.Thread(target=work, args=(P("tp"), "bad")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == {"good": "passed", "bad": "raised"}


def test_messages_outside_jaxtyped_and_on_mixed_meshes():
    mesh = jax.make_mesh(
        (4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    ann = Float[Array, "b d", P("dp", "tp")]

    def f(x):
        assert isinstance(x, ann)  # passes at trace time: decided at compile time
        return x

    with jax.set_mesh(mesh), pytest.raises(jaxshard.ShardingError) as info:
        jax.jit(f)(put((8, 4), mesh, P("dp", None)))
    msg = str(info.value)
    assert "a value checked with isinstance outside any jaxtyped function" in msg
    assert "(Auto/Explicit axes)" in msg


def test_lowered_in_one_thread_compiled_in_another(auto_mesh):
    import threading

    f = layer()
    bad = put((8, 4), auto_mesh, P(None, "tp"))
    lowered = jax.jit(f).lower(bad, put((4, 6), auto_mesh, P(None, "tp")))
    outcome = []

    def compile_it():
        try:
            lowered.compile()
            outcome.append("passed")
        except jaxshard.ShardingError:
            outcome.append("raised")

    t = threading.Thread(target=compile_it)
    t.start()
    t.join()
    assert outcome == ["raised"]
    jnp.ones(3) + 1  # nothing left over for this thread's next compile


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def block(
    x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
) -> Float[Array, "b d", P("dp", None)]:
    return jnp.tanh(x @ w) @ w.T


@jaxshard.jaxtyped(typechecker=beartype.beartype)
def decoder(
    x: Float[Array, "b d", P("dp", None)], ws: list[Float[Array, "d d"]]
) -> Float[Array, "b d", P("dp", None)]:
    for w in ws:  # eight calls of the same function
        x = block(x, w)
    return x


def decoder_inputs(mesh, bad_layer):
    good, bad = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None))
    ws = [
        jax.device_put(jnp.ones((16, 16)), bad if i == bad_layer else good)
        for i in range(8)
    ]
    return jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("dp"))), ws


def test_violations_name_the_call_in_program_order(auto_mesh):
    """Which call of a function (a layer in a loop) each violation is in, in
    program order, the first marked as the likely cause."""
    x, ws = decoder_inputs(auto_mesh, bad_layer=4)
    with pytest.raises(jaxshard.ShardingError) as e:
        jax.jit(decoder)(x, ws)
    lines = str(e.value).splitlines()
    # The weight laid out unlike its siblings, by its path, on the first line.
    assert lines[0] == (
        "3 sharding contracts violated in jit(decoder), found when XLA compiled it: "
        "the likely cause is ws[4], laid out P('tp', None) where 7 of its siblings "
        "(the same weight in the other layers) are P(None, 'tp')."
    )
    assert lines[1].startswith("The first value laid out wrong in program order")
    # Then the violations in program order, each with its call.
    found = [
        re.search(r"block #(\d) of 8", line) for line in lines if "- test_" in line
    ]
    calls = [int(m.group(1)) for m in found if m]
    assert calls == sorted(calls) and 5 in calls
    assert any("block #5 of 8 (in test_jit.decoder), parameter 'w'" in x for x in lines)
    report = jaxshard.verify(
        decoder, mesh=auto_mesh, values={"x": x, "ws": ws}, raise_on_error=False
    )
    bad = [r for r in report.violations if r.name == "w"]
    assert [r.call for r in bad] == ["block #5 of 8"]
    assert all(r.call for r in report.violations)
    assert all(not r.call for r in report.rows if r.ok)


def step(state: dict, x: Float[Array, "b d", P("dp", None)]):
    """Two layers and their optimizer state, as a train step takes them."""
    for w in state["params"].values():
        x = block(x, w)
    return x


def test_two_layers_blame_the_weight_unlike_its_optimizer_state(auto_mesh):
    """With two layers no weight has a majority of siblings: the weight laid out
    unlike the same weight in the optimizer state (paths that end as its does) is
    the likely cause."""
    good, bad = P(None, "tp"), P("tp", None)
    names = ["layers_0", "layers_1"]

    def tree(wrong: str | None):
        return {n: put((16, 16), auto_mesh, bad if n == wrong else good) for n in names}

    state = {"params": tree("layers_1"), "opt": {"mu": tree(None), "nu": tree(None)}}
    x = put((8, 16), auto_mesh, P("dp"))
    with pytest.raises(jaxshard.ShardingError) as e:
        jax.jit(step)(state, x)
    assert (
        str(e.value)
        .splitlines()[0]
        .endswith(
            ": the likely cause is state['params']['layers_1'], laid out P('tp', None) "
            "where 2 of its siblings (the arrays of its shape whose paths end as its "
            "does: its optimizer state) are P(None, 'tp')."
        )
    )


def test_a_program_compiled_ahead_says_its_inputs_were_not_read(auto_mesh):
    """`.lower(...).compile()` has no call whose arguments name the inputs: the
    message says the weight could not be looked for, and how to have it named."""
    x, ws = decoder_inputs(auto_mesh, bad_layer=4)
    with pytest.raises(jaxshard.ShardingError) as e:
        jax.jit(decoder).lower(x, ws).compile()
    lines = str(e.value).splitlines()
    assert lines[0].startswith("3 sharding contracts violated in jit(decoder)")
    assert "the likely cause is the first value laid out wrong" in lines[0]
    assert lines[-1].startswith(
        "The layouts of the program's inputs could not be read (it was compiled "
        "ahead of a call, by `.lower(...).compile()`)"
    )


def test_a_value_passed_on_is_reported_once(auto_mesh):
    """A mis-sharded array checked by an annotated function and again by the one it
    is passed to is one violation, which says where it went."""

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def outer(
        x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
    ) -> Float[Array, "b d", P("dp", None)]:
        return block(x, w)

    x, ws = decoder_inputs(auto_mesh, bad_layer=0)
    with pytest.raises(jaxshard.ShardingError) as e:
        jax.jit(outer)(x, ws[0])
    message = str(e.value)
    details = message.split("\n", 1)[1]  # (the first line names the likely cause)
    assert details.count("parameter 'w'") == 2  # once, and where it was passed on to
    assert "outer, parameter 'w' (passed on to test_jit.block (in " in message


def test_a_value_passed_on_has_one_probe(auto_mesh):
    """A value checked by an annotated function and again by the one it is passed
    to (same annotation) leaves one probe, which reports for both places."""

    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def outer(
        x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d d", P(None, "tp")]
    ) -> Float[Array, "b d", P("dp", None)]:
        return block(block(x, w), w)

    x, ws = decoder_inputs(auto_mesh, bad_layer=-1)
    jaxpr = jax.make_jaxpr(outer)(x, ws[0])
    # x, w, and each block's output: the blocks' x and w are the values passed on.
    probes = [e for e in jaxpr.eqns if e.primitive.name.startswith("jaxshard")]
    assert len(probes) == 4
    jax.jit(outer)(x, ws[0])
    x, ws = decoder_inputs(auto_mesh, bad_layer=0)
    with pytest.raises(jaxshard.ShardingError) as e:
        jax.jit(outer)(x, ws[0])
    message = str(e.value)
    # w, and each block's output, which w laid out so; w reported once, with both
    # places it was passed on to.
    assert message.startswith("3 sharding contracts violated")
    assert message.split("\n", 1)[1].count("parameter 'w'") == 3
    assert "test_jit.block #1 of 2 (in " in message
    assert "test_jit.block #2 of 2 (in " in message
