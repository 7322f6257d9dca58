"""Small decoders shaped like real ones, in flax linen, flax nnx and equinox: an
embedding, blocks of attention and MLP in a Python loop, logical axis names and rules,
optax state, and a jitted train step with shardings and donation.

Each `make_*` returns a `Decoder`: the initialised train state placed on the mesh, a
batch, the step (`jax.jit` with `in_shardings`, `out_shardings`, `donate_argnums`), and
how to break one layer's layout, for the tests of issue-style diagnosis.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import BY_NAME, Float, Int, L


# The mesh is ("data", "fsdp", "tensor"), as flax's lm1b example names it.
RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
)
VOCAB, EMBED, MLP, LAYERS, BATCH, LENGTH = 64, 32, 64, 4, 8, 16

Act = Float[Array, "batch length embed", L("batch", "length", "embed")]
Hidden = Float[Array, "batch length mlp", L("batch", "length", "mlp")]
Tokens = Int[Array, "batch length", L("batch", "length")]
Logits = Float[Array, "batch length vocab", L("batch", "length", "vocab")]
AXES = ("batch", "length", "embed")  # the residual stream's logical axes


@dataclasses.dataclass
class Decoder:
    state: Any  # what the step takes first (and donates)
    batch: Any
    step: Callable  # jitted, with shardings and donation
    loss: Callable  # the forward and loss, unjitted: (state, batch) -> scalar


def tokens(mesh) -> Array:
    x = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)
    return jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None)))


def _norm(x: Array) -> Array:
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def _attend(q: Array, k: Array, v: Array) -> Array:
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bqk,bkd->bqd", weights, v)


# --- flax linen ---------------------------------------------------------------------


def _dense(features: int, names: tuple, name: str | None = None) -> nn.Dense:
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return nn.Dense(features, use_bias=False, kernel_init=init, name=name)


class LinenMlp(nn.Module):
    names: tuple = ("embed", "mlp")  # the first kernel's logical names

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        h: Hidden = nn.relu(_dense(MLP, self.names)(x))
        return _dense(EMBED, ("mlp", "embed"))(h)


class LinenAttention(nn.Module):
    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        q, k, v = (_dense(EMBED, ("embed", "heads"))(x) for _ in range(3))
        return _dense(EMBED, ("heads", "embed"))(_attend(q, k, v))


class LinenBlock(nn.Module):
    mlp_names: tuple = ("embed", "mlp")

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        x = x + LinenAttention()(_norm(x))
        return x + LinenMlp(self.mlp_names)(_norm(x))


class LinenDecoder(nn.Module):
    layers: int = LAYERS
    wrong_layer: int | None = None  # a layer whose MLP kernel is named wrongly

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, tokens: Tokens) -> Logits:
        init = nn.with_logical_partitioning(
            nn.initializers.normal(), ("vocab", "embed")
        )
        embed = nn.Embed(VOCAB, EMBED, embedding_init=init)
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        for i in range(self.layers):
            wrong = ("mlp", "embed") if i == self.wrong_layer else ("embed", "mlp")
            x = LinenBlock(wrong)(x)
        return embed.attend(_norm(x))


def _cross_entropy(logits: Array, targets: Array) -> Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def linen_init(model: LinenDecoder, tx) -> Callable:
    """`init(key, dummy)`: the model's train state, as lm1b makes it."""

    def init(key, dummy):
        params = model.init(key, dummy)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init


def linen_loss(state, batch):
    logits = state.apply_fn({"params": state.params}, batch)
    return _cross_entropy(logits[:, :-1], batch[:, 1:])


def linen_train_step(state, batch, checks: bool = False):
    """A train step, as lm1b's; `checks`: with value checks on the loss and the
    gradients."""
    value, grads = jax.value_and_grad(
        lambda params: linen_loss(state.replace(params=params), batch)
    )(state.params)
    if checks:
        jaxshard.check(jnp.isfinite(value), "loss is {v}", v=value)
        jaxshard.check_finite(grads, name="grads")
    return state.apply_gradients(grads=grads), value


def make_linen(mesh, wrong_layer: int | None = None) -> Decoder:
    """lm1b's init path as written: `jax.eval_shape` of the init for the abstract
    state, `nn.get_partition_spec`, a jitted init with `out_shardings` on a dummy
    batch, all under flax's rules; then its jitted train step."""
    init = linen_init(LinenDecoder(wrong_layer=wrong_layer), optax.adamw(1e-3))
    dummy = jnp.ones((BATCH, LENGTH), jnp.int32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init, jax.random.key(0), dummy)
        specs = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
        state = jax.jit(init, out_shardings=shardings)(jax.random.key(0), dummy)
    return Decoder(
        state, tokens(mesh), _jitted(linen_train_step, mesh, shardings), linen_loss
    )


def _jitted(train_step: Callable, mesh, shardings) -> Callable:
    """`train_step` jitted as a training loop does: the state in and out as
    `shardings` lay it out, donated; the batch split over ("data", "fsdp")."""
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


# --- flax nnx -----------------------------------------------------------------------


def _param(rngs, shape, names) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return nnx.Param(init(rngs.params(), shape))


class NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, names=("embed", "mlp")):
        self.up = _param(rngs, (EMBED, MLP), names)
        self.down = _param(rngs, (MLP, EMBED), ("mlp", "embed"))

    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        h: Hidden = jax.nn.relu(x @ self.up[...])
        return h @ self.down[...]


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, mlp_names=("embed", "mlp")):
        self.qkv = nnx.List(
            [_param(rngs, (EMBED, EMBED), ("embed", "heads")) for _ in range(3)]
        )
        self.out = _param(rngs, (EMBED, EMBED), ("heads", "embed"))
        self.mlp = NnxMlp(rngs, mlp_names)

    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        h = _norm(x)
        q, k, v = (h @ w[...] for w in self.qkv)
        x = x + _attend(q, k, v) @ self.out[...]
        return x + self.mlp(_norm(x))


class NnxDecoder(nnx.Module):
    def __init__(
        self, rngs: nnx.Rngs, wrong_layer: int | None = None, constrain: bool = True
    ):
        self.constrain = constrain  # the embedding's output to the residual's layout
        self.embed = _param(rngs, (VOCAB, EMBED), ("vocab", "embed"))
        self.blocks = nnx.List(
            [
                NnxBlock(
                    rngs, ("mlp", "embed") if i == wrong_layer else ("embed", "mlp")
                )
                for i in range(LAYERS)
            ]
        )

    @jaxshard.jaxtyped
    def __call__(self, tokens: Tokens) -> Logits:
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.constrain:
            x = jax.lax.with_sharding_constraint(x, nn.logical_to_mesh_axes(AXES))
        for block in self.blocks:
            x = block(x)
        return _norm(x) @ self.embed[...].T


def make_nnx(mesh, wrong_layer: int | None = None, constrain: bool = True) -> Decoder:
    """nnx's sharded init (`nnx.get_partition_spec` of an abstract model, a jitted
    constructor whose state is constrained to it) and a functional train step on the
    model's and optimizer's state, jitted with shardings and donation."""

    @nnx.jit
    def create():
        model = NnxDecoder(nnx.Rngs(0), wrong_layer, constrain)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        state = nnx.state((model, optimizer))
        specs = nnx.get_partition_spec(state)
        nnx.update((model, optimizer), jax.lax.with_sharding_constraint(state, specs))
        return model, optimizer

    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        model, optimizer = create()
        graphdef, state = nnx.split((model, optimizer))
        shardings = nnx.get_named_sharding(state, mesh)

    def loss(state, batch):
        model, _ = nnx.merge(graphdef, state)
        logits = model(batch)
        return _cross_entropy(logits[:, :-1], batch[:, 1:])

    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def of_model(model):
            logits = model(batch)
            return _cross_entropy(logits[:, :-1], batch[:, 1:])

        value, grads = nnx.value_and_grad(of_model)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value

    return Decoder(state, tokens(mesh), _jitted(train_step, mesh, shardings), loss)


# --- equinox ------------------------------------------------------------------------


class EqxMlp(eqx.Module):
    up: Float[Array, "embed mlp", BY_NAME]
    down: Float[Array, "mlp embed", BY_NAME]

    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        h: Hidden = jax.nn.relu(x @ self.up)
        return h @ self.down


class EqxBlock(eqx.Module):
    qkv: tuple[Float[Array, "embed heads", BY_NAME], ...]
    out: Float[Array, "heads embed", BY_NAME]
    mlp: EqxMlp

    @jaxshard.jaxtyped
    def __call__(self, x: Act) -> Act:
        h = _norm(x)
        q, k, v = (h @ w for w in self.qkv)
        x = x + _attend(q, k, v) @ self.out
        return x + self.mlp(_norm(x))


class EqxDecoder(eqx.Module):
    embed: Float[Array, "vocab embed", BY_NAME]
    blocks: list[EqxBlock]

    @jaxshard.jaxtyped
    def __call__(self, tokens: Tokens) -> Logits:
        x = jnp.take(self.embed, tokens, axis=0)
        x = jax.lax.with_sharding_constraint(x, jaxshard.partition_spec(Act))
        for block in self.blocks:
            x = block(x)
        return _norm(x) @ self.embed.T


def _eqx_model(key, mesh, wrong_layer: int | None) -> EqxDecoder:
    """Each weight placed as its annotation says under `RULES` (`wrong_layer`: one
    layer's first MLP weight placed transposed)."""
    keys = iter(jax.random.split(key, 64))
    fsdp, tensor = "fsdp", "tensor"

    def w(spec, *shape):
        x = jax.random.normal(next(keys), shape) / jnp.sqrt(shape[0])
        return jax.device_put(x, NamedSharding(mesh, spec))

    blocks = [
        EqxBlock(
            qkv=tuple(w(P(fsdp, tensor), EMBED, EMBED) for _ in range(3)),
            out=w(P(tensor, fsdp), EMBED, EMBED),
            mlp=EqxMlp(
                w(P(tensor, fsdp) if i == wrong_layer else P(fsdp, tensor), EMBED, MLP),
                w(P(tensor, fsdp), MLP, EMBED),
            ),
        )
        for i in range(LAYERS)
    ]
    return EqxDecoder(w(P(tensor, fsdp), VOCAB, EMBED), blocks)


def make_equinox(mesh, wrong_layer: int | None = None) -> Decoder:
    """The model placed as its field annotations say under the rules, optax state
    beside it, and a step jitted with shardings and donation."""
    model = _eqx_model(jax.random.key(0), mesh, wrong_layer)
    tx = optax.adamw(1e-3)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(  # the moments are laid out as the weights; the count
        lambda x: (
            x
            if isinstance(x.sharding, NamedSharding)
            else jax.device_put(x, replicated)
        ),
        tx.init(model),
    )
    state = (model, opt_state)

    def loss(state, batch):
        logits = state[0](batch)
        return _cross_entropy(logits[:, :-1], batch[:, 1:])

    def train_step(state, batch):
        model, opt_state = state
        value, grads = jax.value_and_grad(lambda m: loss((m, None), batch))(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return (eqx.apply_updates(model, updates), opt_state), value

    shardings = jax.tree.map(lambda x: x.sharding, state)
    return Decoder(state, tokens(mesh), _jitted(train_step, mesh, shardings), loss)


# --- an nnx MLP and a step that returns only its loss ---------------------------------


class NnxTwoLayers(nnx.Module):
    """Two nnx.Linear layers placed by nnx's own partitioning metadata, over "tp"."""

    def __init__(self, rngs: nnx.Rngs, use_bias: bool = False):
        def init(names):
            return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

        self.up = nnx.Linear(
            8, 32, use_bias=use_bias, kernel_init=init((None, "tp")), rngs=rngs
        )
        self.down = nnx.Linear(
            32, 8, use_bias=use_bias, kernel_init=init(("tp", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


@nnx.jit
def nnx_loss_step(
    model: NnxTwoLayers, opt: nnx.Optimizer, x: Float[Array, "b d", P("dp", None)]
) -> Float[Array, "", P()]:
    """An nnx step that returns only the loss, as NNX steps often do: the
    optimizer's update is dead code, so its moments and step count are inputs the
    program never reads."""

    def loss_fn(model):
        return (model(x) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss
