"""Messages a user can act on: a misspelled name is matched to the one meant, one
wording for an axis the mesh lacks wherever it is found, and a dimension bound
twice says where each size came from."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import put
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float, L
from jaxshard._errors import did_you_mean
from jaxshard._verify.abstract import stray_dims


def test_did_you_mean():
    assert did_you_mean("db", ["dp", "tp"]) == " Did you mean 'dp'?"
    assert did_you_mean("hiden", ["hidden", "heads"]) == " Did you mean 'hidden'?"
    assert did_you_mean("db", ["dp"], inline=True) == " (did you mean 'dp'?)"
    assert did_you_mean(["db", "xyz"], ["dp"]) == " Did you mean 'dp' for 'db'?"
    assert did_you_mean("zzz", ["dp", "tp"]) == ""
    assert did_you_mean("dp", ["dp"]) == ""  # a name is not its own suggestion


# --- an axis the mesh lacks: one wording everywhere ----------------------------------

NEEDLE = "the annotation's spec P('db', None) names mesh axis 'db' (did you mean 'dp'?)"


def _typo(x: Float[Array, "b d", P("db", None)]) -> Float[Array, "b d"]:
    return x


def test_a_misspelled_mesh_axis_eagerly_in_jit_shardings_and_verify(explicit_mesh):
    f = jaxshard.jaxtyped(_typo)
    x = put((8, 16), explicit_mesh, P("dp", None))
    with jax.set_mesh(explicit_mesh):
        for call in (lambda: f(x), lambda: jax.jit(f)(x)):
            with pytest.raises(jaxshard.ShardingError, match=r"did you mean 'dp'"):
                call()
        with pytest.raises(ValueError) as e:
            jaxshard.shardings(_typo, explicit_mesh)
    assert str(e.value).startswith("jaxshard.shardings(_typo), parameter 'x': ")
    assert NEEDLE in str(e.value) and "has axes 'dp', 'tp'" in str(e.value)
    with pytest.raises(ValueError) as e:
        jaxshard.verify(_typo, mesh=explicit_mesh, dims={"b": 8, "d": 16})
    assert str(e.value).startswith("jaxshard.verify(_typo): x: ") and NEEDLE in str(
        e.value
    )


def test_shardings_names_the_rule_that_names_an_axis_the_mesh_lacks(auto_mesh):
    def g(x: Float[Array, "b d", L("batch", None)]) -> Float[Array, "b d"]:
        return x

    with pytest.raises(ValueError) as e:
        jaxshard.shardings(g, auto_mesh, rules=[("batch", "db")])
    message = str(e.value)
    assert "parameter 'x'" in message and NEEDLE in message
    assert "(batch -> 'db')" in message
    assert "Resource axis" not in message  # not JAX's own


def test_a_misspelled_logical_name(auto_mesh):
    def g(x: Float[Array, "b d", L("batch", None)]) -> Float[Array, "b d"]:
        return x

    with pytest.raises(
        jaxtyping.AnnotationError, match=r"names 'batch' \(did you mean 'bacth'\?\)"
    ):
        jaxshard.shardings(g, auto_mesh, rules=[("bacth", "dp")])


def test_a_misspelled_dimension(auto_mesh):
    def g(x: Float[Array, "b hidden", P("dp", None)]) -> Float[Array, "b"]:
        return x.sum(1)

    with pytest.raises(
        ValueError,
        match=r"`dims` names 'hiden', which no annotation uses \(did you mean 'hidd",
    ):
        jaxshard.abstract_args(g, auto_mesh, {"b": 8, "hiden": 16})
    assert stray_dims(g, {"hiden": 16}).endswith("Did you mean 'hidden'?")


def test_a_misspelled_setting():
    with pytest.raises(ValueError, match="Did you mean 'checks'"):
        jaxshard.config(chekcs="off")
    with pytest.raises(ValueError, match="Did you mean 'deferred'"):
        jaxshard.config(checks="defered")


# --- each failure said once, a wrong rank as a shape error ---------------------------


def _rank(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b"]:
    return x.sum(1)


def _two(x: Float[Array, "b d", P("dp", None)] | Float[Array, "b d", P(None, "tp")]):
    return x


def test_a_sharding_violation_is_said_once(typechecker, explicit_mesh):
    """The first line says what failed; it is not said again under "Sharding:",
    which lists only the others (here, the union's other member)."""
    f = jaxshard.jaxtyped(_two, typechecker=typechecker)
    with jax.set_mesh(explicit_mesh):
        with pytest.raises(jaxshard.ShardingError) as one:
            jaxshard.jaxtyped(_rank, typechecker=typechecker)(
                put((8, 16), explicit_mesh, P("tp"))
            )
        with pytest.raises(jaxshard.ShardingError) as two:
            f(put((8, 4), explicit_mesh, P()))
    message = str(one.value)
    first = message.splitlines()[0]
    assert first.startswith("test_messages._rank, parameter 'x': this array ")
    assert "is sharded as P('tp', None)" in first
    assert message.count("is sharded as P('tp', None)") == 1
    assert "Sharding:" not in message
    message = str(two.value)
    first = message.splitlines()[0]
    assert "expects P('dp', None)" in first and first.endswith("(1 more below).")
    section = message.split("\nSharding:\n", 1)[1]
    assert section.startswith("- test_messages._two, parameter 'x': this array ")
    assert "expects P(None, 'tp')" in section and "P('dp', None)" not in section


def test_a_wrong_rank_is_a_shape_error_that_names_it(typechecker, explicit_mesh):
    """An array of rank 3 given to a rank-2 annotation: jaxtyping's TypeCheckError
    whose first line names the rank, not a ShardingError about a layout no spec of
    rank 2 describes (whatever it is laid out as)."""
    f = jaxshard.jaxtyped(_rank, typechecker=typechecker)
    with jax.set_mesh(explicit_mesh):
        for spec in (P("dp"), P(None, "dp")):
            x = put((8, 16, 64), explicit_mesh, spec)
            for call in (f, jax.jit(f)):
                with pytest.raises(jaxtyping.TypeCheckError) as e:
                    call(x)
                assert not isinstance(e.value, jaxshard.ShardingError)
                message = str(e.value)
                assert message.splitlines()[0] == (
                    "test_messages._rank, parameter 'x': this array has 3 "
                    "dimensions, not the 2 expected by the type hint."
                )
                assert "Sharding:" not in message and "is sharded" not in message


# --- a dimension bound twice ---------------------------------------------------------


class AdamState(NamedTuple):
    mu: dict
    nu: dict
    count: Array


def _state():
    params = {f"w{i}": jnp.ones((4, 4)) for i in range(10)}
    return AdamState(params, params, jnp.zeros(()))


def _pair(x: Float[Array, "batch d"], y: Float[Array, "batch d"], opt: AdamState):
    return x


def test_a_dimension_bound_twice_says_where(typechecker):
    f = jaxshard.jaxtyped(_pair, typechecker=typechecker)
    with pytest.raises(jaxtyping.TypeCheckError) as e:
        f(jnp.ones((8, 16)), jnp.ones((8, 17)), _state())
    first, *rest = str(e.value).splitlines()
    assert first.startswith(
        "test_messages._pair: dimension 'd' is 16 from parameter 'x' "
        "(shape (8, 16)) but 17 in parameter 'y' (shape (8, 17))."
    )
    # The arguments, a line each: the optimizer state summarised.
    called = [line for line in rest if line.startswith("Called with parameters")]
    assert called == [
        "Called with parameters: {'x': f32[8,16], 'y': f32[8,17], "
        "'opt': AdamState(21 arrays)}"
    ]
    assert len(rest) < 15


def test_a_dimension_bound_twice_inside_jit():
    f = jaxshard.jaxtyped(_pair)
    with pytest.raises(jaxtyping.TypeCheckError, match="'d' is 16 from parameter 'x'"):
        jax.jit(f)(jnp.ones((8, 16)), jnp.ones((8, 17)), _state())


def test_a_dimension_bound_twice_by_a_return_value_and_within_one_array():
    @jaxshard.jaxtyped
    def transpose(x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        return x.T

    @jaxshard.jaxtyped
    def square(x: Float[Array, "d d"]) -> Float[Array, "d d"]:
        return x

    @jaxshard.jaxtyped
    def broadcast(x: Float[Array, "*b d"], y: Float[Array, "*b #d"]):
        return x

    with pytest.raises(jaxtyping.TypeCheckError, match="but 3 in the return value"):
        transpose(jnp.ones((2, 3)))
    with pytest.raises(jaxtyping.TypeCheckError, match="'d' is both 2 and 3 in param"):
        square(jnp.ones((2, 3)))
    broadcast(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 1)))  # `#d` broadcasts
    with pytest.raises(jaxtyping.TypeCheckError, match="'d' is 4 from parameter 'x'"):
        broadcast(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)))


def test_a_failing_parameter_is_shown_on_a_line(typechecker):
    @jaxshard.jaxtyped(typechecker=typechecker)
    def f(opt: AdamState, x: Float[Array, "b"]) -> Float[Array, "b"]:
        return x

    with pytest.raises(jaxtyping.TypeCheckError) as e:
        f(_state(), jnp.ones((2, 3)))
    message = str(e.value)
    assert "Actual value: f32[2,3]\n" in message
    assert "'opt': AdamState(21 arrays), 'x': f32[2,3]}" in message
    assert "dimension" not in message.splitlines()[0]  # no conflict: a rank


def test_reading_the_arguments_never_replaces_the_error():
    """A `PyTree[...]` is not looked into: its `isinstance` would check its leaves
    again, where a symbolic dimension cannot be evaluated."""

    @jaxshard.jaxtyped
    def f(
        x: jaxtyping.PyTree[Float[Array, ""]],
        y: jaxtyping.PyTree[Float[Array, "a+1 a"]],
    ):
        return x

    x = jnp.zeros((), jnp.int32)
    with pytest.raises(jaxtyping.TypeCheckError, match="Called with parameters: {'x'"):
        f([x, {"k": x}], (jnp.zeros((1, 1)),))
