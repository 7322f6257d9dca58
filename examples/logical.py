"""A MaxText-style decoder block annotated with logical axis names only, verified for a
256-chip TPU v5e pod under two rule tables, then a flax linen decoder checked against
its own parameter metadata.

The annotations never name a mesh axis: `L("activation_batch", ...)` for activations
and `BY_NAME` (the shape string's names are the logical names) for weights. A rule
table maps the names to the mesh's axes, as MaxText's `logical_axis_rules` do, so the
same model is checked as pure FSDP and as FSDP plus tensor parallelism. A third table,
with one wrong rule, shows the violation naming it.

The flax linen decoder's weights are made by `nn.Dense` and `nn.Embed` with
`nn.with_logical_partitioning`: no annotation reaches them, and none is needed.
`jaxshard.Partitioned` checks each one against the names its box carries.

Run: `python examples/logical.py` (needs libtpu: `pip install 'jaxshard[tpu]'`;
without it, 8 simulated CPU devices stand in for the pod).
"""

import importlib.util
import os
import sys
import typing


os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu only compiles here

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402
from flax.linen.spmd import with_logical_constraint  # noqa: E402
from jax import Array  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import BY_NAME, Float, Int, L  # noqa: E402


# --- the rule tables (MaxText's names) -----------------------------------------------

FSDP = [
    ("activation_batch", ("data", "fsdp")),
    ("activation_heads", None),
    ("activation_mlp", None),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("mlp", None),
    ("kv", None),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_kv", None),
]
FSDP_TP = [
    ("activation_batch", ("data", "fsdp")),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_kv", None),
]
# A mistake: the MLP's activations on "fsdp", which the batch already uses. flax's
# resolution skips a rule whose mesh axis is taken, so the annotation says
# "unsharded" while the weights make them sharded over "tensor".
WRONG = [("activation_mlp", "fsdp"), *FSDP_TP]

# --- the block, in logical names only -------------------------------------------------

X = Float[
    Array, "b s d", L("activation_batch", "activation_length", "activation_embed")
]
Heads = Float[
    Array,
    "b s h k",
    L("activation_batch", "activation_length", "activation_heads", None),
]
Hidden = Float[
    Array, "b s m", L("activation_batch", "activation_length", "activation_mlp")
]


@jaxshard.jaxtyped(typechecker=beartype)
def attention(
    x: X,
    wq: Float[Array, "embed heads kv", BY_NAME],
    wo: Float[Array, "heads kv embed", BY_NAME],
) -> X:
    q = jaxshard.constrain(jnp.einsum("bsd,dhk->bshk", x, wq), Heads)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, q) / jnp.sqrt(q.shape[-1])
    heads = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores), q)
    heads = jaxshard.constrain(heads, Heads)
    return jaxshard.constrain(x + jnp.einsum("bshk,hkd->bsd", heads, wo), X)


@jaxshard.jaxtyped(typechecker=beartype)
def mlp(
    x: X,
    wi: Float[Array, "embed mlp", BY_NAME],
    wo: Float[Array, "mlp embed", BY_NAME],
) -> X:
    h = hidden(jax.nn.gelu(jnp.einsum("bsd,dm->bsm", x, wi)))
    return jaxshard.constrain(x + jnp.einsum("bsm,md->bsd", h, wo), X)


@jaxshard.jaxtyped(typechecker=beartype)
def hidden(h: Hidden) -> Hidden:
    """The MLP's hidden activations, as the rules say they are laid out."""
    return h


@jaxshard.jaxtyped(typechecker=beartype)
def decoder_layer(
    x: X,
    wq: Float[Array, "embed heads kv", BY_NAME],
    wo: Float[Array, "heads kv embed", BY_NAME],
    wi: Float[Array, "embed mlp", BY_NAME],
    wm: Float[Array, "mlp embed", BY_NAME],
) -> X:
    return mlp(attention(x, wq, wo), wi, wm)


DIMS = {"b": 256, "s": 2048, "d": 4096, "embed": 4096, "heads": 32, "kv": 128}
DIMS |= {"h": 32, "k": 128, "mlp": 16384, "m": 16384}


# --- a flax linen decoder, checked by its own metadata -------------------------------


class Decoder(nn.Module):
    """Weights made by flax's layers, partitioned by logical names."""

    vocab: int = 32000
    embed: int = 4096
    mlp: int = 16384

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.02)
        x = nn.Embed(
            self.vocab,
            self.embed,
            embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")),
        )(tokens)
        x = with_logical_constraint(
            x, ("activation_batch", "activation_length", "activation_embed")
        )
        h = nn.Dense(
            self.mlp, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp"))
        )(nn.LayerNorm(scale_init=nn.with_logical_partitioning(
            nn.initializers.ones, ("embed",)))(x))  # fmt: skip
        h = with_logical_constraint(
            jax.nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp")
        )
        y = nn.Dense(
            self.embed, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed"))
        )(h)
        return with_logical_constraint(
            x + y, ("activation_batch", "activation_length", "activation_embed")
        )


def forward(
    params: jaxshard.Partitioned,
    tokens: Int[Array, "b s", L("activation_batch", "activation_length")],
) -> X:
    return typing.cast(Array, Decoder().apply(params, tokens))


# --- verifying ----------------------------------------------------------------------


def pod() -> jax.sharding.Mesh:
    if importlib.util.find_spec("libtpu") is None:
        print(
            "libtpu is not installed: 8 simulated CPU devices stand in for the pod.\n"
        )
        jax.config.update("jax_num_cpu_devices", 8)
        types = (jax.sharding.AxisType.Auto,) * 3
        return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=types)
    return jaxshard.tpu_mesh("v5e:16x16", {"data": 2, "fsdp": 16, "tensor": 8})


def main() -> int:
    mesh = pod()
    small = importlib.util.find_spec("libtpu") is None
    dims = {k: v // 16 if small and k in ("b", "s") else v for k, v in DIMS.items()}
    for name, rules in (("fsdp", FSDP), ("fsdp_tp", FSDP_TP)):
        with jaxshard.axis_rules(rules, name=name):
            report = jaxshard.verify(
                decoder_layer, mesh=mesh, dims=dims, dtypes=jnp.bfloat16
            )
        wq = next(r for r in report.rows if r.name == "wq")
        print(f"Rules {name!r}: all {len(report.rows)} contracts hold; wq is "
              f"{wq.actual_type}.")  # fmt: skip
        print(
            report.memory
            and f"  memory per device: {report.memory.total / 2**30:.2f} GiB"
        )

    with jaxshard.axis_rules(WRONG, name="wrong"):
        report = jaxshard.verify(
            decoder_layer, mesh=mesh, dims=dims, dtypes=jnp.bfloat16,
            raise_on_error=False,
        )  # fmt: skip
    print("\nRules 'wrong':")
    for row in report.violations:
        print(f"- {row.function}, {row.name}: {row.reason}")
    caught = [(r.function, r.name) for r in report.violations]
    if ("hidden", "h") not in caught:
        print(f"Expected the MLP's hidden activations to be caught: {caught}")
        return 1
    print("The wrong rule was caught, and named.")

    tokens = jax.ShapeDtypeStruct((dims["b"], dims["s"]), jnp.int32)
    abstract = jax.eval_shape(Decoder().init, jax.random.key(0), tokens)
    report = jaxshard.verify(
        forward, mesh=mesh, dims=dims, values={"params": abstract}, rules=FSDP_TP,
    )  # fmt: skip
    print("\nThe linen decoder's own parameters, under 'fsdp_tp':")
    for row in report.rows:
        if row.function == "check_partitioning":
            print(f"  {row.name}: {row.expected_type}  ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
