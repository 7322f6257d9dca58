"""The annotation objects themselves: exports, reprs, validation, compact syntax."""

import pickle
import sys
import textwrap
from typing import Optional

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, Int, Shaped


def test_every_jaxtyping_dtype_is_exported():
    names = {
        name
        for name in dir(jaxtyping)
        if isinstance(getattr(jaxtyping, name), type)
        and issubclass(getattr(jaxtyping, name), jaxtyping.AbstractDtype)
        and name != "AbstractDtype"
    }
    assert {
        "Float",
        "Float32",
        "BFloat16",
        "Int",
        "UInt8",
        "Bool",
        "Shaped",
        "Key",
    } <= names
    for name in names:
        ours = getattr(jaxshard, name)
        assert name in jaxshard.__all__
        assert issubclass(ours, getattr(jaxtyping, name))
        assert ours.dtypes == getattr(jaxtyping, name).dtypes


def test_two_items_is_jaxtypings_annotation():
    """Made by jaxtyping, with jaxshard's dtype class (a subclass of jaxtyping's) as
    its `.dtype`."""
    plain = Float[Array, "batch d"]
    assert plain.dtype is jaxshard.Float and issubclass(plain.dtype, jaxtyping.Float)
    assert type(plain) is type(jaxtyping.Float[Array, "batch d"])
    assert plain.dim_str == "batch d"
    assert jaxshard.partition_spec(plain) is None


def test_sharded_annotation_is_a_subclass_with_a_readable_repr():
    ann = Float[Array, "batch d", P("dp", None)]
    assert issubclass(ann, jaxtyping.AbstractArray)
    assert ann.__mro__[1].dim_str == "batch d"
    assert ann.__mro__[1].dtype is jaxshard.Float
    assert repr(ann) == "Float[Array, 'batch d', P('dp', None)]"
    assert str(ann) == repr(ann)
    assert jaxshard.partition_spec(ann) == P("dp", None)
    tricky = Shaped[Array, "a b c", P(("dp", "tp"), None, P.UNCONSTRAINED)]
    assert (
        repr(tricky) == "Shaped[Array, 'a b c', P(('dp', 'tp'), None, P.UNCONSTRAINED)]"
    )


def test_sharded_annotation_pickles():
    # (jax.Array itself does not pickle, so neither do annotations that name it.)
    ann = Float[np.ndarray, "batch d", P("dp", None)]
    back = pickle.loads(pickle.dumps(ann))
    assert repr(back) == repr(ann)
    assert jaxshard.partition_spec(back) == P("dp", None)


# Annotations pickled by jaxshard before its modules moved into subpackages (protocol
# 4, numpy's array type): they name `jaxshard._array_types.with_spec`,
# `jaxshard._logical.L` and `jaxshard._logical.BY_NAME`.
OLD_PICKLES = {
    "Float[ndarray, 'batch seq embed', L('batch', None, 'embed')]": (
        "gASVxAAAAAAAAACMFWpheHNoYXJkLl9hcnJheV90eXBlc5SMCXdpdGhfc3BlY5STlIwIYnVpbHRpbnOU"
        "jAdnZXRhdHRylJOUjAhqYXhzaGFyZJSMBUZsb2F0lJOUjAtfX2dldGl0ZW1fX5SGlFKUjAVudW1weZSM"
        "B25kYXJyYXmUk5SMD2JhdGNoIHNlcSBlbWJlZJSGlIWUUpSMEWpheHNoYXJkLl9sb2dpY2FslIwBTJST"
        "lIwFYmF0Y2iUTowFZW1iZWSUh5RSlIaUUpQu"
    ),
    "Float[ndarray, 'embed mlp', BY_NAME]": (
        "gASVrwAAAAAAAACMFWpheHNoYXJkLl9hcnJheV90eXBlc5SMCXdpdGhfc3BlY5STlIwIYnVpbHRpbnOU"
        "jAdnZXRhdHRylJOUjAhqYXhzaGFyZJSMBUZsb2F0lJOUjAtfX2dldGl0ZW1fX5SGlFKUjAVudW1weZSM"
        "B25kYXJyYXmUk5SMCWVtYmVkIG1scJSGlIWUUpSMEWpheHNoYXJkLl9sb2dpY2FslIwHQllfTkFNRZST"
        "lIaUUpQu"
    ),
}


@pytest.mark.parametrize("shown", OLD_PICKLES)
def test_annotations_pickled_before_the_move_load(shown):
    import base64

    back = pickle.loads(base64.b64decode(OLD_PICKLES[shown]))
    assert repr(back) == shown
    with jaxshard.axis_rules([("embed", "dp"), ("mlp", None), ("batch", None)]):
        assert jaxshard.partition_spec(back) in (P(None, None, "dp"), P("dp", None))


def test_union_members_each_get_the_spec():
    ann = Float[Array | np.ndarray, "b", P("dp")]
    members = ann.__args__
    assert [jaxshard.partition_spec(m) for m in members] == [P("dp"), P("dp")]
    assert jaxshard.partition_spec(ann) == P("dp")
    scalar = Float[Array | float, "", P()]
    assert float in scalar.__args__


@pytest.mark.parametrize(
    "item, fragment",
    [
        ((Array, "a b", ("dp",)), "must be a `jax.sharding.PartitionSpec`"),
        ((Array, "a b", "dp"), "must be a `jax.sharding.PartitionSpec`"),
        ((Array, "a", P("dp", None)), "has 2 entries but the shape has only 1"),
        ((Array, "a b", P("dp", "dp")), "uses mesh axis 'dp' twice"),
        ((Array, "a b", P(("dp", "tp"), "tp")), "uses mesh axis 'tp' twice"),
        ((Array, "a b", P(3)), "where a mesh axis name"),
    ],
)
def test_bad_annotations_fail_early(item, fragment):
    with pytest.raises(jaxtyping.AnnotationError, match=fragment.replace("(", r"\(")):
        Float[item]


def test_a_spec_without_its_shape_string_says_so():
    """`Float[Array, P("data", None)]`: the shape string forgotten. An
    AnnotationError where the annotation is made, showing where each item goes, not
    jaxtyping's `AttributeError: 'P' object has no attribute 'strip'`."""
    with pytest.raises(jaxtyping.AnnotationError) as e:
        Float[Array, P("data", None)]
    message = str(e.value)
    assert message.startswith("`Float[Array, P('data', None)]` has no shape string")
    assert "Write `Float[Array, \"dims...\", P('data', None)]`" in message
    assert "`Float[Array, \"batch seq\", P('data', None)]`" in message
    with pytest.raises(jaxtyping.AnnotationError, match="has no shape string"):
        Float[Array, jaxshard.L("batch", None)]
    with pytest.raises(jaxtyping.AnnotationError) as e:
        Float[Array, P("data"), "b d"]
    assert "has the spec before the shape string" in str(e.value)
    assert "Write `Float[Array, 'b d', P('data')]`" in str(e.value)
    with pytest.raises(jaxtyping.AnnotationError, match="got 3 of type int"):
        Float[Array, 3]


def test_variadic_allows_a_longer_spec():
    ann = Float[Array, "*batch d", P("dp", "tp", None)]
    assert jaxshard.partition_spec(ann) == P("dp", "tp", None)


# --- compact syntax -----------------------------------------------------------------


def test_compact_syntax_from_the_issue():
    ann = jaxshard.sharded(Float, "[batch/dp] seqlen [heads/(tp,fsdp)] d")
    assert repr(ann) == repr(
        Float[Array, "batch seqlen heads d", P("dp", None, ("tp", "fsdp"), None)]
    )
    assert jaxshard.partition_spec(ann) == P("dp", None, ("tp", "fsdp"), None)
    assert ann.dim_str == "batch seqlen heads d"
    assert ann.array_type is Array


@pytest.mark.parametrize(
    "text, dims, spec",
    [
        ("[batch-1/dp] d", "batch-1 d", P("dp", None)),
        ("b [d/tp]", "b d", P(None, "tp")),
        ("[b/( tp , fsdp )] 4", "b 4", P(("tp", "fsdp"), None)),
        ("[b/dp] *rest", "b *rest", P("dp")),
        ("[b/dp] ...", "b ...", P("dp")),
        ("x y", "x y", P(None, None)),
        ("[#b/dp]", "#b", P("dp")),
    ],
)
def test_compact_syntax_cases(text, dims, spec):
    ann = jaxshard.sharded(Float, text)
    assert ann.dim_str == dims
    assert jaxshard.partition_spec(ann) == spec


def test_compact_syntax_array_type_keyword_and_jaxtyping_dtype():
    ann = jaxshard.sharded(jaxtyping.Int, "[n/dp]", array_type=np.ndarray)
    assert ann.array_type is np.ndarray
    assert ann.__mro__[1].dtype is jaxtyping.Int
    assert jaxshard.partition_spec(jaxshard.sharded(Int, "[n/dp]")) == P("dp")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[batch] d", r"written `\[dim/axis\]`"),
        ("[batch/] d", r"written `\[dim/axis\]`"),
        ("[b d/dp]", "no spaces"),
        ("[b/(tp,)x] d", "written"),
        ("[b/()]", "tuple of mesh axis names"),
        ("b] d", "unbalanced bracket"),
        ("*rest [d/tp]", "comes after the variadic"),
        ("[*b/dp] d", "variadic dimension '\\*b' is sharded"),
        ("[a/dp] [b/dp]", "uses mesh axis 'dp' twice"),
    ],
)
def test_compact_syntax_errors(text, fragment):
    with pytest.raises(jaxtyping.AnnotationError, match=fragment):
        jaxshard.sharded(Float, text)


def test_compact_syntax_wants_a_dtype_class():
    with pytest.raises(jaxtyping.AnnotationError, match="dtype class"):
        jaxshard.sharded("Float", "[b/dp]")


# --- works wherever jaxtyping works -------------------------------------------------


def test_optional_union_pytree_and_return(typechecker, jaxtyped, explicit_mesh):
    from helpers import put

    good = put((8, 4), explicit_mesh, P("dp"))
    bad = put((8, 4), explicit_mesh, P(None, "tp"))

    @jaxtyped(typechecker=typechecker)
    def f(
        x: Optional[Float[Array, "b d", P("dp")]],
        tree: jaxtyping.PyTree[Float[Array, "b d", P("dp")]],
    ) -> Float[Array, "b d", P("dp")] | None:
        return x

    assert f(None, {"a": good}) is None
    assert f(good, [good, good]) is good
    with pytest.raises(jaxtyping.TypeCheckError):
        f(bad, {"a": good})
    with pytest.raises(jaxtyping.TypeCheckError):
        f(good, {"a": good, "b": bad})

    @jaxtyped(typechecker=typechecker)
    def g(x: Float[Array, "b d", P("dp")]) -> Float[Array, "b d", P("dp")]:
        return bad

    with pytest.raises(jaxtyping.TypeCheckError, match="return value"):
        g(good)


def test_equinox_module_fields(typechecker, explicit_mesh):
    import equinox as eqx
    from helpers import put

    @jaxshard.jaxtyped(typechecker=typechecker)
    class Linear(eqx.Module):
        w: Float[Array, "d_in d_out", P(None, "tp")]

    Linear(put((4, 8), explicit_mesh, P(None, "tp")))
    with pytest.raises(jaxshard.ShardingError, match="parameter 'w'"):
        Linear(put((4, 8), explicit_mesh, P("dp", None)))


def test_import_hook(tmp_path, monkeypatch, explicit_mesh):
    from helpers import put

    (tmp_path / "hooked_module.py").write_text(
        textwrap.dedent(
            """
            from jax import Array
            from jax.sharding import PartitionSpec as P
            from jaxshard import Float

            def f(x: Float[Array, "b d", P("dp")]):
                return x
            """
        )
    )
    monkeypatch.syspath_prepend(tmp_path)
    with jaxtyping.install_import_hook("hooked_module", "beartype.beartype"):
        import hooked_module
    try:
        hooked_module.f(put((8, 4), explicit_mesh, P("dp")))
        with pytest.raises(jaxtyping.TypeCheckError):
            hooked_module.f(put((8, 4), explicit_mesh, P(None, "tp")))
    finally:
        sys.modules.pop("hooked_module")


def test_plain_isinstance(explicit_mesh):
    from helpers import put

    ann = Float[Array, "b d", P("dp")]
    assert isinstance(put((8, 4), explicit_mesh, P("dp")), ann)
    assert not isinstance(put((8, 4), explicit_mesh, P("tp")), ann)
    assert not isinstance(jax.numpy.ones((8, 4), jax.numpy.int32), ann)


def test_compact_syntax_inside_the_subscript(explicit_mesh):
    """`Float[Array, "[batch/dp] d"]`: the compact syntax as a subscript, which static
    type checkers read as a type (see tests/static_types.py)."""
    ann = Float[Array, "[batch/dp] d"]
    assert jaxshard.partition_spec(ann) == P("dp", None)
    assert ann.dim_str == "batch d" and ann.dtype is jaxshard.Float
    assert repr(ann) == repr(jaxshard.sharded(Float, "[batch/dp] d"))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit_mesh, P("dp")))
    assert isinstance(x, ann)
    assert not isinstance(jax.device_put(x, NamedSharding(explicit_mesh, P())), ann)
