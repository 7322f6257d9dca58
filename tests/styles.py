"""Small models written in the styles of third-party code bases, with the contracts a
maintainer adopting jaxshard would add to them (issue 49: jaxshard on code written by
others).

- `lm1b`: flax linen as flax's examples/lm1b writes it: a `TransformerConfig`-like
  struct passed as a static argument, `nn.with_logical_partitioning` on every layer's
  params (3-D attention kernels named by two logical axes, a position embedding with
  no metadata), a rule table of lists, a `TrainState` made by a jitted init with
  `out_shardings` from `nn.logical_to_mesh_sharding`, and a train step jitted with
  `in_shardings=(state_shardings, data_sharding, None)`, `static_argnums=(2, 3, 4)` and
  `donate_argnums=0`.
- `llama`: plain JAX as jax-llm-examples' llama3/qwen3 write it: Explicit mesh axes
  ("x", "y", "z"), a `ShardingRules` dataclass of logical name -> mesh axes inside a
  static `Config`, weights as registered dataclasses whose fields are a union of an
  array and an int8 `QuantArray`, an `ArrayInfo` per weight with its logical axes, a
  `shardings(cfg)` class method giving a tree of `NamedSharding`s, einsums with
  `out_sharding=`, `reshard`, `auto_axes`, a KV cache with prefill and decode, and an
  MoE layer whose experts run in `jax.shard_map(..., check_vma=False)`.
- `maxtext`: MaxText's rule table (lists of lists, empty lists, a name given twice
  as a fallback) on a mesh that names every parallelism, most of size 1.
- `gemma`: flax nnx as flax's examples/gemma writes it: a ShardingConfig-like
  dataclass of PartitionSpecs, `kernel_metadata={"out_sharding": ...}`, projections
  called with `out_sharding=`, a step under `nnx.jit` donating model and optimizer.

The tests are in tests/styles/. An xfail marker names its point of issue 49: 1 to 7
are the issue's own scenarios, in its order (all hold now); 8 on, what these tests
found.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from flax.training import train_state
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import Float, Int, Int8, L


def _noise(key: Array, shape: tuple) -> Array:
    """Deterministic values in [-1, 1] that differ by key: jax.random's normal costs
    seconds to compile for a few dozen weights on 8 CPU devices, this nothing."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    seed = key.ravel()[-1].astype(jnp.float32)
    n = math.prod(shape)
    return jnp.sin(jnp.arange(n, dtype=jnp.float32) * 12.9898 + seed).reshape(shape)


def noise_init(scale: float = 1.0) -> Callable:
    """An initializer of `_noise` times `scale` over the square root of the first
    dimension (flax's and jax's `(key, shape, dtype)`)."""

    def init(key: Array, shape: tuple, dtype: Any = jnp.float32) -> Array:
        return (_noise(key, shape) * scale / shape[0] ** 0.5).astype(dtype)

    return init


# --- flax linen, as flax's examples/lm1b ---------------------------------------------

# As lm1b's config writes them, lists; "batch" added by the adopter for the
# activations' contracts, over the data and fsdp axes as the data is.
LM1B_MESH_AXES = ("data", "fsdp", "tensor")
LM1B_DATA_SHARDING = ["data", "fsdp"]  # lm1b's config.data_sharding, a list
LM1B_RULES = [
    ["batch", ["data", "fsdp"]],
    ["mlp", "tensor"],
    ["vocab", "tensor"],
    ["embed", "fsdp"],
    ["heads", "tensor"],
]

# The residual stream, as the adopter annotates it.
Residual = Float[Array, "batch length embed", L("batch", None, "embed")]
InputTokens = Int[Array, "batch length", P(("data", "fsdp"), None)]


@struct.dataclass
class LmConfig:
    vocab_size: int = 64
    emb_dim: int = 32
    num_heads: int = 4
    qkv_dim: int = 32
    mlp_dim: int = 64
    num_layers: int = 3
    max_len: int = 16
    dropout_rate: float = 0.0  # the dropout layers and their rng, without the cost
    deterministic: bool = False
    kernel_init: Callable = noise_init()  # xavier_uniform in lm1b
    bias_init: Callable = nn.initializers.zeros


def _named(init: Callable, *names) -> Callable:
    return nn.with_logical_partitioning(init, names)


class MlpBlock(nn.Module):
    config: LmConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        x = nn.Dense(
            cfg.mlp_dim,
            kernel_init=_named(cfg.kernel_init, "embed", "mlp"),
            bias_init=_named(cfg.bias_init, "mlp"),
        )(inputs)
        x = nn.Dropout(cfg.dropout_rate)(nn.relu(x), deterministic=cfg.deterministic)
        out = nn.Dense(
            inputs.shape[-1],
            kernel_init=_named(cfg.kernel_init, "mlp", "embed"),
            bias_init=_named(cfg.bias_init, "embed"),
        )(x)
        return nn.Dropout(cfg.dropout_rate)(out, deterministic=cfg.deterministic)


def _layer_norm(name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(
        bias_init=_named(nn.initializers.zeros, "embed"),
        scale_init=_named(nn.initializers.ones, "embed"),
        name=name,
    )


class EncoderDecoder1DBlock(nn.Module):
    config: LmConfig

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, inputs: Residual, decoder_mask=None) -> Residual:
        cfg = self.config
        x = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            qkv_features=cfg.qkv_dim,
            # 2 names for the 3-D kernels DenseGeneral makes, as lm1b has them.
            kernel_init=_named(cfg.kernel_init, "embed", "kv"),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=cfg.dropout_rate,
            deterministic=cfg.deterministic,
        )(_layer_norm()(inputs), mask=decoder_mask)
        x = inputs + nn.Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        return x + MlpBlock(cfg)(_layer_norm()(x))


class Decoder(nn.Module):
    config: LmConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.emb_dim,
            embedding_init=_named(noise_init(8.0), "vocab", "embed"),
        )
        y = embed(jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1])  # shifted right
        # A learned position embedding without metadata, as lm1b's AddPositionEmbs.
        pos = self.param(
            "pos_embedding",
            noise_init(0.02),
            (1, cfg.max_len, cfg.emb_dim),
        )
        y = y + pos[:, : y.shape[1]]
        y = nn.with_logical_constraint(y, ("batch", None, "embed"))
        for i in range(cfg.num_layers):
            block = EncoderDecoder1DBlock(cfg, name=f"encoderdecoderblock_{i}")
            y = block(y, decoder_mask=decoder_mask)
        y = _layer_norm(name="encoderdecoder_norm")(y)
        return nn.Dense(
            cfg.vocab_size,
            kernel_init=_named(cfg.kernel_init, "embed", "vocab"),
            bias_init=_named(cfg.bias_init, "vocab"),
            name="logitdense",
        )(y)


class TransformerLM(nn.Module):
    config: LmConfig

    @nn.compact
    def __call__(self, inputs):
        mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0),
            nn.make_causal_mask(inputs),
        )
        return Decoder(self.config, name="decoder")(inputs, decoder_mask=mask)


def lm1b_schedule(step):
    return 1e-3 * jnp.minimum(1.0, (step + 1) / 10)


@jaxshard.jaxtyped
def train_step(
    state: train_state.TrainState,
    batch: dict[str, InputTokens],
    config: LmConfig,
    learning_rate_fn: Callable,
    label_smoothing: float = 0.0,
    dropout_rng: Any = None,
):
    """lm1b's train step: the loss weighted by the non-padding tokens, metrics out."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1.0, 0.0)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = TransformerLM(config).apply(
            {"params": params}, inputs, rngs={"dropout": dropout_rng}
        )
        targets = optax.smooth_labels(
            jax.nn.one_hot(inputs, config.vocab_size), label_smoothing
        )
        loss = optax.softmax_cross_entropy(logits, targets) * weights
        return loss.sum() / weights.sum(), logits

    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = {"loss": loss, "learning_rate": learning_rate_fn(state.step)}
    return state.apply_gradients(grads=grads), metrics


@dataclasses.dataclass
class Lm1b:
    """What lm1b's `train_and_evaluate` holds: the state, its shardings, a batch."""

    mesh: Any
    config: LmConfig
    state: Any
    state_shardings: Any  # a TrainState of NamedShardings
    state_specs: Any  # a TrainState of logical PartitionSpecs (nn.get_partition_spec)
    batch: dict
    data_sharding: Any
    dropout_rng: Any

    def jitted(self, with_shardings: bool = True) -> Callable:
        """`train_step` jitted as lm1b jits it (or without shardings)."""
        if not with_shardings:
            return jax.jit(train_step, static_argnums=(2, 3, 4))
        return jax.jit(
            train_step,
            in_shardings=(self.state_shardings, self.data_sharding, None),
            out_shardings=(self.state_shardings, None),
            static_argnums=(2, 3, 4),
            donate_argnums=0,
        )

    def args(self, state=None) -> tuple:
        state = self.state if state is None else state
        return (state, self.batch, self.config, lm1b_schedule, 0.0, self.dropout_rng)


def make_lm1b(mesh, config: LmConfig | None = None) -> Lm1b:
    """lm1b's `setup_initial_state`: the abstract state under `jax.eval_shape`, its
    logical specs, their mesh shardings under the rules, a jitted init with
    `out_shardings`, then the boxes unboxed."""
    config = LmConfig() if config is None else config
    tx = optax.adamw(lm1b_schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    model = TransformerLM(config.replace(deterministic=True))

    def init(key):
        dummy = jnp.ones((2, config.max_len), jnp.int32)
        params = model.init(key, dummy)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    key = jax.random.key(0)
    abstract = jax.eval_shape(init, key)
    specs = nn.get_partition_spec(abstract)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LM1B_RULES):
        shardings = nn.logical_to_mesh_sharding(specs, mesh, LM1B_RULES)
        state = jax.jit(init, out_shardings=shardings)(key)
    state = jax.tree.map(
        lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
        state,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
    data_sharding = NamedSharding(mesh, P(LM1B_DATA_SHARDING))
    tokens = jax.random.randint(jax.random.key(1), (8, config.max_len), 1, 64)
    batch = {"inputs": jax.device_put(tokens, data_sharding)}
    return Lm1b(
        mesh, config, state, shardings, specs, batch, data_sharding, jax.random.key(2)
    )


def misplaced(tree, path: str, sharding) -> Any:
    """`tree` with the leaf at `path` (a `jax.tree_util.keystr`) placed by
    `sharding`, as a checkpoint restored with the wrong shardings would have it."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # A flax box holds its array in `.value`: the path names the box.
    found = [jax.tree_util.keystr(p).removesuffix(".value") for p, _ in leaves]
    assert path in found, (path, found)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.device_put(x, sharding) if where == path else x
            for where, (_, x) in zip(found, leaves)
        ],
    )


# --- plain JAX on Explicit axes, as jax-llm-examples' llama3 and qwen3 ----------------

AxisName = str | tuple[str, ...] | None
LLAMA_MESH_AXES = ("x", "y", "z")  # x: the batch; y, z: 2-D tensor parallelism


def static_field(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axes, one field per name, as llama3's config has it."""

    batch: AxisName = "x"
    sequence: AxisName = None
    act_embed: AxisName = None
    head_dim: AxisName = None
    qkv_embed: AxisName = None
    q_heads: AxisName = ("y", "z")
    kv_heads: AxisName = "y"
    o_heads: AxisName = ("y", "z")
    o_embed: AxisName = None
    embed_up: AxisName = None
    ffw_up: AxisName = ("y", "z")
    ffw_down: AxisName = ("y", "z")
    embed_down: AxisName = None
    vocab_in: AxisName = None
    vocab_out: AxisName = ("y", "z")
    moe_e_experts: AxisName = "z"
    moe_e_up_embed: AxisName = None
    moe_e_up_ffw: AxisName = "y"
    moe_e_down_ffw: AxisName = "y"
    moe_e_down_embed: AxisName = None
    moe_e_ep: AxisName = "z"  # the expert function's expert parallelism
    moe_e_tp: AxisName = "y"  # and its tensor parallelism


def rule_pairs(rules: ShardingRules) -> list[tuple[str, AxisName]]:
    """The dataclass as the `(name, mesh axes)` pairs jaxshard.axis_rules takes
    today (what an adopter has to write until it takes the dataclass itself)."""
    return [(f.name, getattr(rules, f.name)) for f in dataclasses.fields(rules)]


def logical_to_physical(logical: tuple, rules: ShardingRules) -> P:
    return P(*(None if name is None else getattr(rules, name) for name in logical))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:
    embed: int = 32
    ffw_size: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    num_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    moe_layers: tuple[
        int, ...
    ] = ()  # these layers' feed-forward is a mixture of experts
    moe_num_experts: int = 4
    moe_experts_per_tok: int = 2
    moe_ffw_size: int = 16
    quant_layer: bool = False  # int8 feed-forward weights
    rules: ShardingRules = dataclasses.field(default_factory=ShardingRules)
    mesh: Any = None
    # A copy-paste slip in the experts' metadata: we_down named as we_up is.
    copy_pasted_expert_names: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """A weight before it exists: its shape, dtype, logical axes and initializer."""

    shape: tuple[int, ...] = static_field()
    dtype: Any = static_field()
    logical_axes: tuple = static_field()
    initializer: Callable | None = static_field(None)


is_info = functools.partial(lambda cls, x: isinstance(x, cls), ArrayInfo)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    """int8 values and a scale per output column (the input axis 0 quantized)."""

    quant: Int8[Array, "..."] | ArrayInfo
    scale: Float[Array, "..."] | ArrayInfo
    out_scaling: bool = static_field(True)
    shape = property(lambda self: self.quant.shape)


def _int8_init(key: Array, shape: tuple, dtype: Any) -> Array:
    return jnp.round(_noise(key, shape) * 127).astype(dtype)


def quantize(x: Any) -> QuantArray:
    """Quantizes over axis 1 of a 3-D expert weight, else axis 0."""
    axis = 1 if len(x.shape) == 3 else 0
    if isinstance(x, ArrayInfo):
        kept = tuple(n for i, n in enumerate(x.logical_axes) if i != axis)
        shape = tuple(s for i, s in enumerate(x.shape) if i != axis)
        quant = ArrayInfo(x.shape, jnp.int8, x.logical_axes, _int8_init)
        scale = ArrayInfo(shape, jnp.float32, kept, jax.nn.initializers.constant(1e-2))
        return QuantArray(quant, scale)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = amax / 127.0 + 1e-12
    return QuantArray(jnp.round(x / scale).astype(jnp.int8), jnp.squeeze(scale, axis))


def einsum(subscripts: str, lhs: Array, rhs: Any, out_sharding: Any = None) -> Array:
    """`jnp.einsum` of an array or a QuantArray."""
    if isinstance(rhs, QuantArray):
        out = jnp.einsum(
            subscripts, lhs, rhs.quant.astype(lhs.dtype), out_sharding=out_sharding
        )
        return out * rhs.scale
    return jnp.einsum(subscripts, lhs, rhs, out_sharding=out_sharding)


class _Init:
    """`abstract(cfg)` is a tree of ArrayInfo; `shardings(cfg)` the same tree of
    NamedShardings; `init(key, cfg)` the arrays, made already placed."""

    @classmethod
    def abstract(cls, cfg: Config, *args) -> Any:
        raise NotImplementedError

    @classmethod
    def shardings(cls, cfg: Config, *args) -> Any:
        return jax.tree.map(
            lambda info: NamedSharding(
                cfg.mesh, logical_to_physical(info.logical_axes, cfg.rules)
            ),
            cls.abstract(cfg, *args),
            is_leaf=is_info,
        )

    @classmethod
    def init(cls, key: Array, cfg: Config, *args) -> Any:
        abstract = cls.abstract(cfg, *args)
        infos, treedef = jax.tree.flatten(abstract, is_leaf=is_info)
        shardings = jax.tree.leaves(cls.shardings(cfg, *args))

        @functools.partial(jax.jit, out_shardings=shardings)
        def make(key):
            keys = iter(jax.random.split(key, len(infos)))
            return [
                info.initializer(next(keys), info.shape, info.dtype) for info in infos
            ]

        return jax.tree.unflatten(treedef, make(key))


def _he(key: Array, shape: tuple, dtype: Any) -> Array:
    """He-scaled over the first axis."""
    return (_noise(key, shape) * (6.0 / shape[0]) ** 0.5).astype(dtype)


_ones = jax.nn.initializers.ones

# The adopter's annotations, in the model's own logical names.
Act = Float[Array, "batch seq embed", L("batch", "sequence", "act_embed")]
Tokens = Int[Array, "batch seq", L("batch", "sequence")]
Wq = Float[Array, "embed q_heads head_dim", L("qkv_embed", "q_heads", "head_dim")]
Wkv = Float[Array, "embed kv_heads head_dim", L("qkv_embed", "kv_heads", "head_dim")]
Wo = Float[Array, "q_heads head_dim embed", L("o_heads", "head_dim", "o_embed")]
WUp = Float[Array, "embed ffw", L("embed_up", "ffw_up")]
WDown = Float[Array, "ffw embed", L("ffw_down", "embed_down")]
Gamma = Float[Array, "embed", L("act_embed")]
WeUp = Float[
    Array, "experts embed moe_ffw", L("moe_e_experts", "moe_e_up_embed", "moe_e_up_ffw")
]
WeDown = Float[
    Array,
    "experts moe_ffw embed",
    L("moe_e_experts", "moe_e_down_ffw", "moe_e_down_embed"),
]
CacheKV = Float[
    Array,
    "batch kv_heads max_seq head_dim",
    L("batch", "kv_heads", "sequence", "head_dim"),
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionLayer(_Init):
    q: Wq | ArrayInfo
    k: Wkv | ArrayInfo
    v: Wkv | ArrayInfo
    o: Wo | ArrayInfo

    @classmethod
    def abstract(cls, cfg: Config) -> "AttentionLayer":
        d, h, kh, k = cfg.embed, cfg.q_heads, cfg.kv_heads, cfg.head_dim
        return AttentionLayer(
            q=ArrayInfo(
                (d, h, k), jnp.float32, ("qkv_embed", "q_heads", "head_dim"), _he
            ),
            k=ArrayInfo(
                (d, kh, k), jnp.float32, ("qkv_embed", "kv_heads", "head_dim"), _he
            ),
            v=ArrayInfo(
                (d, kh, k), jnp.float32, ("qkv_embed", "kv_heads", "head_dim"), _he
            ),
            o=ArrayInfo(
                (h, k, d), jnp.float32, ("o_heads", "head_dim", "o_embed"), _he
            ),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLPLayer(_Init):
    w_gate: WUp | QuantArray | ArrayInfo
    w_up: WUp | QuantArray | ArrayInfo
    w_down: WDown | QuantArray | ArrayInfo

    @classmethod
    def abstract(cls, cfg: Config) -> "MLPLayer":
        d, f = cfg.embed, cfg.ffw_size
        up = ArrayInfo((d, f), jnp.float32, ("embed_up", "ffw_up"), _he)
        layer = MLPLayer(
            w_gate=up,
            w_up=up,
            w_down=ArrayInfo((f, d), jnp.float32, ("ffw_down", "embed_down"), _he),
        )
        if cfg.quant_layer:
            layer = MLPLayer(quantize(up), quantize(up), quantize(layer.w_down))
        return layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoELayer(_Init):
    w_router: Float[Array, "embed experts", L("moe_e_up_embed", None)] | ArrayInfo
    we_gate: WeUp | QuantArray | ArrayInfo
    we_up: WeUp | QuantArray | ArrayInfo
    we_down: WeDown | QuantArray | ArrayInfo

    @classmethod
    def abstract(cls, cfg: Config) -> "MoELayer":
        e, d, f = cfg.moe_num_experts, cfg.embed, cfg.moe_ffw_size
        up_names = ("moe_e_experts", "moe_e_up_embed", "moe_e_up_ffw")
        down_names = ("moe_e_experts", "moe_e_down_ffw", "moe_e_down_embed")
        if cfg.copy_pasted_expert_names:
            down_names = up_names

        def init(key, shape, dtype):  # He-scaled over each expert's input axis
            return (_noise(key, shape) * (6.0 / shape[1]) ** 0.5).astype(dtype)

        layer = MoELayer(
            w_router=ArrayInfo((d, e), jnp.float32, ("moe_e_up_embed", None), _he),
            we_gate=ArrayInfo((e, d, f), jnp.float32, up_names, init),
            we_up=ArrayInfo((e, d, f), jnp.float32, up_names, init),
            we_down=ArrayInfo((e, f, d), jnp.float32, down_names, init),
        )
        if cfg.quant_layer:
            layer = dataclasses.replace(
                layer,
                we_gate=quantize(layer.we_gate),
                we_up=quantize(layer.we_up),
                we_down=quantize(layer.we_down),
            )
        return layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer(_Init):
    attn: AttentionLayer
    ffw: MLPLayer | MoELayer
    attn_pre_gamma: Gamma | ArrayInfo
    attn_post_gamma: Gamma | ArrayInfo

    @classmethod
    def abstract(cls, cfg: Config, idx: int) -> "Layer":
        moe = idx in cfg.moe_layers
        gamma = ArrayInfo((cfg.embed,), jnp.float32, ("act_embed",), _ones)
        return Layer(
            attn=AttentionLayer.abstract(cfg),
            ffw=MoELayer.abstract(cfg) if moe else MLPLayer.abstract(cfg),
            attn_pre_gamma=gamma,
            attn_post_gamma=gamma,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights(_Init):
    layers: list[Layer]
    embedding: Float[Array, "vocab embed", L(None, "vocab_in")] | ArrayInfo
    gamma_final: Gamma | ArrayInfo
    lm_head: Float[Array, "embed vocab", L("vocab_in", "vocab_out")] | ArrayInfo

    @classmethod
    def abstract(cls, cfg: Config) -> "Weights":
        d, v = cfg.embed, cfg.vocab_size
        return Weights(
            layers=[Layer.abstract(cfg, i) for i in range(cfg.num_layers)],
            embedding=ArrayInfo((v, d), jnp.float32, (None, "vocab_in"), _he),
            gamma_final=ArrayInfo((d,), jnp.float32, ("act_embed",), _ones),
            lm_head=ArrayInfo((d, v), jnp.float32, ("vocab_in", "vocab_out"), _he),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache(_Init):
    k: list[CacheKV | ArrayInfo]
    v: list[CacheKV | ArrayInfo]
    iter: Int[Array, ""] | ArrayInfo  # the next position to write
    batch_size: int = static_field(1)

    @classmethod
    def abstract(cls, cfg: Config, batch_size: int) -> "KVCache":
        shape = (batch_size, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
        names = ("batch", "kv_heads", "sequence", "head_dim")
        zeros = jax.nn.initializers.zeros
        info = ArrayInfo(shape, jnp.float32, names, zeros)
        return KVCache(
            k=[info] * cfg.num_layers,
            v=[info] * cfg.num_layers,
            iter=ArrayInfo((), jnp.int32, (), zeros),
            batch_size=batch_size,
        )


def _l2p(cfg: Config, *names) -> P:
    return logical_to_physical(names, cfg.rules)


def rms_norm(x: Array, gamma: Array) -> Array:
    return gamma * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@functools.partial(jax.sharding.auto_axes, out_sharding=P("x", ("y", "z"), None, None))
def attention(q: Array, k: Array, v: Array, q_offset: Array) -> Array:
    """Grouped-query causal attention; the compiler lays out its insides."""
    b, qh, t, d = q.shape
    kh, kt = k.shape[1], k.shape[2]
    scores = jnp.einsum("bhgtd,bhTd->bhgtT", q.reshape(b, kh, qh // kh, t, d), k)
    causal = (jnp.arange(t)[:, None] + q_offset) >= jnp.arange(kt)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores * d**-0.5, -1e30), axis=-1)
    return jnp.einsum("bhgtT,bhTd->bhgtd", weights, v).reshape(b, qh, t, d)


@jaxshard.jaxtyped
def attention_block(
    x: Act, layer: AttentionLayer, cfg: Config, cache_kv: Any, pos: Any
) -> tuple[Act, Any]:
    q = einsum("btd,dhk->bhtk", x, layer.q)
    k = einsum("btd,dhk->bhtk", x, layer.k)
    v = einsum("btd,dhk->bhtk", x, layer.v)
    if cache_kv is not None:  # decode or prefill into the cache
        k_cache, v_cache = cache_kv
        k = jax.sharding.reshard(k, jax.typeof(k_cache).sharding.spec)
        v = jax.sharding.reshard(v, jax.typeof(v_cache).sharding.spec)
        k = jax.lax.dynamic_update_slice_in_dim(k_cache, k, pos, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(v_cache, v, pos, axis=2)
    out = attention(q, k, v, pos)
    spec = _l2p(cfg, "batch", "sequence", "act_embed")
    return einsum("bhtk,hkd->btd", out, layer.o, out_sharding=spec), (k, v)


@jaxshard.jaxtyped
def mlp_block(x: Act, layer: MLPLayer, cfg: Config) -> Act:
    gate = jax.nn.silu(einsum("btd,df->btf", x, layer.w_gate))
    up = einsum("btd,df->btf", x, layer.w_up)
    spec = _l2p(cfg, "batch", "sequence", "act_embed")
    return einsum("btf,fd->btd", gate * up, layer.w_down, out_sharding=spec)


def _expert_specs(cfg: Config, layer: MoELayer) -> tuple:
    """The shard_map in_specs of the three expert weights (a QuantArray of specs
    for a quantized one, as qwen3 writes them)."""
    up = _l2p(cfg, "moe_e_ep", None, "moe_e_tp")
    down = _l2p(cfg, "moe_e_ep", "moe_e_tp", None)
    specs = []
    for w, spec in ((layer.we_gate, up), (layer.we_up, up), (layer.we_down, down)):
        if isinstance(w, QuantArray):
            kept = P(spec[0], spec[2])  # the scale has no axis 1
            spec = dataclasses.replace(w, quant=spec, scale=kept)
        specs.append(spec)
    return tuple(specs)


def _resharded(w: Any, spec: Any) -> Any:
    if isinstance(w, QuantArray):
        return dataclasses.replace(
            w,
            quant=jax.sharding.reshard(w.quant, spec.quant),
            scale=jax.sharding.reshard(w.scale, spec.scale),
        )
    return jax.sharding.reshard(w, spec)


def _dense(w: Any) -> Array:
    """An expert weight's block as floats (int8 times its scale)."""
    if isinstance(w, QuantArray):
        return w.quant.astype(jnp.float32) * w.scale[:, None, :]
    return w


@jaxshard.jaxtyped
def moe_block(x: Act, layer: MoELayer, cfg: Config) -> Act:
    """Top-k routing (replicated), then every local expert on every token inside
    a shard_map over the expert and tensor axes, the outputs summed over both."""
    scores = jnp.einsum(
        "btd,de->bte", x, jax.sharding.reshard(layer.w_router, P()), out_sharding=P("x")
    )
    top_w, top_i = jax.lax.top_k(
        jax.nn.softmax(scores, axis=-1), cfg.moe_experts_per_tok
    )
    combine = jnp.sum(
        jax.nn.one_hot(top_i, cfg.moe_num_experts) * top_w[..., None], axis=-2
    )  # [batch, seq, experts]
    ep, tp = _l2p(cfg, "moe_e_ep")[0], _l2p(cfg, "moe_e_tp")[0]
    x_spec = _l2p(cfg, "batch", "sequence", None)
    w_specs = _expert_specs(cfg, layer)
    weights = [
        _resharded(w, s)
        for w, s in zip((layer.we_gate, layer.we_up, layer.we_down), w_specs)
    ]
    combine = jax.sharding.reshard(combine, P("x", None, ep))

    @functools.partial(
        jax.shard_map,
        mesh=cfg.mesh,
        in_specs=(x_spec, *w_specs, P("x", None, ep)),
        out_specs=x_spec,
        check_vma=False,
    )
    @jaxshard.jaxtyped
    def experts(
        x: Float[Array, "batch seq embed", L("batch", "sequence", None)],
        we_gate: WeUp | QuantArray,
        we_up: WeUp | QuantArray,
        we_down: WeDown | QuantArray,
        combine: Float[
            Array, "batch seq experts", L("batch", "sequence", "moe_e_experts")
        ],
    ) -> Float[Array, "batch seq embed", L("batch", "sequence", None)]:
        gate = jnp.einsum("btd,edf->ebtf", x, _dense(we_gate))
        up = jnp.einsum("btd,edf->ebtf", x, _dense(we_up))
        out = jnp.einsum("ebtf,efd->ebtd", jax.nn.silu(gate) * up, _dense(we_down))
        out = jnp.einsum("ebtd,bte->btd", out, combine)
        return jax.lax.psum(out, tuple(a for a in (ep, tp) if a is not None))

    out = experts(x, *weights, combine)
    return jax.sharding.reshard(out, _l2p(cfg, "batch", "sequence", "act_embed"))


@jaxshard.jaxtyped
def forward_layer(
    x: Act, layer: Layer, cfg: Config, cache_kv: Any = None, pos: Any = 0
) -> tuple[Act, Any]:
    attn, kv = attention_block(
        rms_norm(x, layer.attn_pre_gamma), layer.attn, cfg, cache_kv, pos
    )
    x = x + attn
    h = rms_norm(x, layer.attn_post_gamma)
    ffw = moe_block if isinstance(layer.ffw, MoELayer) else mlp_block
    return x + ffw(h, layer.ffw, cfg), kv


@jaxshard.jaxtyped
def forward(
    tokens: Tokens, weights: Weights, cfg: Config, cache: KVCache | None = None
) -> tuple[Float[Array, "batch seq vocab", L("batch", "sequence", "vocab_out")], Any]:
    """The logits, and the cache written (prefill or decode) or the keys and values."""
    jaxshard.check_tree(weights)  # every weight as its field's annotation says
    spec = _l2p(cfg, "batch", "sequence", "act_embed")
    x = weights.embedding.at[tokens, :].get(out_sharding=spec)
    pos = 0 if cache is None else cache.iter
    kvs = []
    for i, layer in enumerate(weights.layers):
        cache_kv = None if cache is None else (cache.k[i], cache.v[i])
        x, kv = forward_layer(x, layer, cfg, cache_kv, pos)
        kvs.append(kv)
    logits = einsum("btd,dv->btv", rms_norm(x, weights.gamma_final), weights.lm_head)
    if cache is None:
        return logits, kvs
    cache = dataclasses.replace(
        cache,
        k=[k for k, _ in kvs],
        v=[v for _, v in kvs],
        iter=cache.iter + tokens.shape[1],
    )
    return logits, cache


def prefill(tokens: Array, weights: Weights, cache: KVCache, cfg: Config):
    """The prompt through the model into the cache, jitted with the cache donated
    and the outputs laid out as `shardings(cfg)` say, as llama3's prefill."""
    logits_sharding = NamedSharding(
        cfg.mesh, _l2p(cfg, "batch", "sequence", "vocab_out")
    )
    cache_shardings = KVCache.shardings(cfg, cache.batch_size)
    tokens = jax.sharding.reshard(tokens, _l2p(cfg, "batch", "sequence"))
    step = jax.jit(
        forward, donate_argnums=(3,), out_shardings=(logits_sharding, cache_shardings)
    )
    return step(tokens, weights, cfg, cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def decode_step(last_tokens: Array, weights: Weights, cache: KVCache, cfg: Config):
    logits, cache = forward(last_tokens, weights, cfg, cache)
    return jax.sharding.reshard(jnp.argmax(logits[:, -1], axis=-1), P()), cache


def llama_config(mesh, **overrides) -> Config:
    return Config(mesh=mesh, **overrides)


# --- flax linen under MaxText's rule table --------------------------------------------

# Every parallelism MaxText names is a mesh axis; those a run does not use have size 1.
MAXTEXT_MESH_AXES = (
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "context",
    "tensor",
    "tensor_sequence",
    "expert",
    "autoregressive",
)
MAXTEXT_MESH_SHAPE = (1, 1, 4, 1, 1, 2, 1, 1, 1)
# A table in the shape of MaxText's base.yml, as its YAML loads: lists of lists, []
# for unsharded, a name given twice (the second a fallback when the first's mesh axes
# are taken by an earlier rule), one rule's mesh axes a bare string.
MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["activation_length", ["context"]],
    ["activation_embed", ["tensor"]],
    ["activation_mlp", ["tensor", "tensor_sequence"]],
    ["activation_exp", ["expert"]],
    ["activation_kv_length", []],
    ["exp", "expert"],
    ["mlp_moe", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]],
    ["embed_moe", ["fsdp", "fsdp_transpose", "context"]],
    ["embed_moe", ["fsdp", "context"]],
    ["mlp", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]],
    ["vocab", ["tensor", "tensor_sequence", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "context", "expert"]],
    ["embed", ["fsdp", "context", "expert"]],
    ["norm", ["tensor"]],
    ["heads", ["tensor", "tensor_sequence", "autoregressive"]],
    ["kv", []],
    ["cache_batch", []],
]

MtAct = Float[
    Array,
    "batch length embed",
    L("activation_batch", "activation_length", "activation_embed"),
]
MtTokens = Int[Array, "batch length", L("activation_batch", "activation_length")]


def _mt_param(module: nn.Module, name: str, shape: tuple, names: tuple) -> Array:
    init = noise_init()  # MaxText's truncated normal, cheaper to compile
    return module.param(name, nn.with_logical_partitioning(init, names), shape)


class MtMlpBlock(nn.Module):
    mlp_dim: int = 64

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, x: MtAct) -> MtAct:
        d = x.shape[-1]
        wi = _mt_param(self, "wi", (d, self.mlp_dim), ("embed", "mlp"))
        wo = _mt_param(self, "wo", (self.mlp_dim, d), ("mlp", "embed"))
        h = jax.nn.gelu(x @ wi)
        h = nn.with_logical_constraint(
            h, ("activation_batch", "activation_length", "activation_mlp")
        )
        out = h @ wo
        return nn.with_logical_constraint(
            out, ("activation_batch", "activation_length", "activation_embed")
        )


class MtMoeBlock(nn.Module):
    num_experts: int = 4
    top_k: int = 2
    mlp_dim: int = 16
    wi_names: tuple = ("exp", "embed_moe", "mlp_moe")

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, x: MtAct) -> MtAct:
        d, e, m = x.shape[-1], self.num_experts, self.mlp_dim
        gate = _mt_param(self, "gate", (d, e), ("embed", None))
        wi = _mt_param(self, "wi", (e, d, m), self.wi_names)
        wo = _mt_param(self, "wo", (e, m, d), ("exp", "mlp_moe", "embed_moe"))
        top_w, top_i = jax.lax.top_k(jax.nn.softmax(x @ gate, axis=-1), self.top_k)
        combine = jnp.sum(jax.nn.one_hot(top_i, e) * top_w[..., None], axis=-2)
        h = jax.nn.silu(jnp.einsum("btd,edm->btem", x, wi))
        out = jnp.einsum("btem,emd,bte->btd", h, wo, combine)
        return nn.with_logical_constraint(
            out, ("activation_batch", "activation_length", "activation_embed")
        )


class MtDecoder(nn.Module):
    vocab: int = 64
    emb_dim: int = 32
    num_layers: int = 3
    # A layer whose wi has a name copied from another code base's table, one that
    # this table does not know (flax leaves such a dimension unsharded, silently).
    wrong_moe_layer: int | None = None

    @nn.compact
    @jaxshard.jaxtyped
    def __call__(self, tokens: MtTokens) -> Float[Array, "batch length vocab"]:
        table = _mt_param(
            self, "token_embedder", (self.vocab, self.emb_dim), ("vocab", "embed")
        )
        x = nn.with_logical_constraint(
            table[tokens], ("activation_batch", "activation_length", "activation_embed")
        )
        for i in range(self.num_layers):
            x = x + MtMlpBlock(name=f"mlp_{i}")(x)
            wrong = i == self.wrong_moe_layer
            wi_names = ("exp", "moe_e_up_embed" if wrong else "embed_moe", "mlp_moe")
            x = x + MtMoeBlock(wi_names=wi_names, name=f"moe_{i}")(x)
        scale = self.param(
            "decoder_norm",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (self.emb_dim,),
        )
        return (x * scale) @ table.T


def make_maxtext(mesh, wrong_moe_layer: int | None = None):
    """MaxText's init path: the abstract boxed params, their shardings under the
    table, a jitted init laid out by them. Returns the model, the boxed params and a
    batch laid out as the data is."""
    model = MtDecoder(wrong_moe_layer=wrong_moe_layer)
    tokens = jnp.zeros((8, 16), jnp.int32)
    key = jax.random.key(0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(MAXTEXT_RULES):
        abstract = jax.eval_shape(model.init, key, tokens)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract), mesh, MAXTEXT_RULES
        )
        params = jax.jit(model.init, out_shardings=shardings)(key, tokens)
    data = NamedSharding(mesh, P(("data", "fsdp", "fsdp_transpose", "expert")))
    batch = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    return model, params, jax.device_put(batch, data)


def abstract_weights(cfg: Config) -> Weights:
    """The weights as `jax.ShapeDtypeStruct`s laid out by `Weights.shardings(cfg)`,
    for `jax.jit(...).lower` or `jaxshard.verify`."""
    return jax.tree.map(
        lambda info, sharding: jax.ShapeDtypeStruct(
            info.shape, info.dtype, sharding=sharding
        ),
        Weights.abstract(cfg),
        Weights.shardings(cfg),
        is_leaf=is_info,
    )


# --- flax nnx on Explicit axes, as flax's examples/gemma -----------------------------

GEMMA_MESH_AXES = ("fsdp", "tensor")


@dataclasses.dataclass(slots=True, frozen=True)
class GemmaSharding:
    """Each weight's and activation's PartitionSpec, by the letters of its
    dimensions, as gemma's ShardingConfig names them."""

    emb_vd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None

    @staticmethod
    def fsdp_tp(fsdp: str = "fsdp", tp: str = "tensor") -> "GemmaSharding":
        return GemmaSharding(
            emb_vd=P(tp, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(tp),
            act_btd=P(fsdp, None, tp),
            act_btf=P(fsdp, None, tp),
        )


# The adopter's annotations, written out from GemmaSharding.fsdp_tp().
GemmaBtd = Float[Array, "batch seq embed", P("fsdp", None, "tensor")]
GemmaTokens = Int[Array, "batch seq", P("fsdp", None)]


class GemmaFeedForward(nnx.Module):
    def __init__(self, d: int, f: int, shd: GemmaSharding, rngs: nnx.Rngs):
        def linear(din, dout, spec):
            return nnx.Linear(
                din,
                dout,
                use_bias=False,
                kernel_init=noise_init(),
                kernel_metadata={"out_sharding": spec},
                rngs=rngs,
            )

        self.shd = shd
        self.gate_proj = linear(d, f, shd.ffw_weight_df)
        self.up_proj = linear(d, f, shd.ffw_weight_df)
        self.down_proj = linear(f, d, shd.ffw_weight_fd)

    @jaxshard.jaxtyped
    def __call__(self, x: GemmaBtd) -> GemmaBtd:
        act = self.shd.act_btf
        h = nnx.gelu(self.gate_proj(x, out_sharding=act))
        h = h * self.up_proj(x, out_sharding=act)
        return self.down_proj(h, out_sharding=self.shd.act_btd)


class GemmaRMSNorm(nnx.Module):
    def __init__(self, d: int, shd: GemmaSharding):
        spec = shd.rms_norm_weight
        self.scale = nnx.Param(jnp.zeros((d,)), out_sharding=spec)

    def __call__(self, x: Array) -> Array:
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class GemmaBlock(nnx.Module):
    def __init__(self, d: int, f: int, shd: GemmaSharding, rngs: nnx.Rngs):
        self.pre_ffw_norm = GemmaRMSNorm(d, shd)
        self.mlp = GemmaFeedForward(d, f, shd, rngs)

    @jaxshard.jaxtyped
    def __call__(self, x: GemmaBtd) -> GemmaBtd:
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaTransformer(nnx.Module):
    def __init__(
        self,
        shd: GemmaSharding,
        rngs: nnx.Rngs,
        vocab: int = 64,
        d: int = 32,
        f: int = 64,
        layers: int = 3,
    ):
        self.shd = shd
        self.embedder = nnx.Embed(
            vocab,
            d,
            embedding_init=noise_init(8.0),
            embedding_metadata={"out_sharding": shd.emb_vd},
            rngs=rngs,
        )
        self.layers = nnx.List([GemmaBlock(d, f, shd, rngs) for _ in range(layers)])
        self.final_norm = GemmaRMSNorm(d, shd)

    @jaxshard.jaxtyped
    def __call__(
        self, tokens: GemmaTokens
    ) -> Float[Array, "batch seq vocab", P("fsdp", None, None)]:
        x = self.embedder(tokens, out_sharding=self.shd.act_btd)
        for layer in self.layers:
            x = layer(x)
        table = jax.sharding.reshard(self.embedder.embedding[...], P(None, "tensor"))
        x = self.final_norm(x)
        return jnp.einsum("btd,vd->btv", x, table, out_sharding=P("fsdp", None, None))


def gemma_train_step(model: GemmaTransformer, optimizer: nnx.Optimizer, batch: Array):
    """gemma's nnx train step: the model and the optimizer updated in place."""
    jaxshard.check_partitioning(model)  # every weight as its metadata says

    def loss_fn(model):
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch[:, 1:]
        ).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make_gemma(mesh):
    """The model made under the mesh (each weight placed as its metadata says), its
    optimizer, and a batch of 9 tokens per row (8 in, 8 targets)."""
    with jax.set_mesh(mesh):
        model = GemmaTransformer(GemmaSharding.fsdp_tp(), nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = jax.random.randint(jax.random.key(1), (8, 9), 0, 64)
    return model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
