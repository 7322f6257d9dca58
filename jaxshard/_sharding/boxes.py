"""flax's boxes, as jaxshard reads them without importing flax: linen's
partitioning boxes (`nn.Partitioned`, `nn.LogicallyPartitioned`) and nnx's Variables
(`nnx.Param`, ...), the arrays they hold, and paths that name a boxed array as the
model does (without the box's own `.value`)."""

from typing import Any

import jax


def is_variable(value: Any) -> bool:
    """A `flax.nnx.Variable` (`nnx.Param`, ...), without importing flax."""
    return type(value).__module__.startswith("flax.nnx") and hasattr(value, "get_value")


def is_box(x: Any) -> bool:
    """A flax linen partitioning box, or an nnx Variable."""
    return is_variable(x) or type(x).__name__ in _BOXES and hasattr(x, "names")


_BOXES = ("Partitioned", "LogicallyPartitioned")


def unboxed_paths(tree: Any) -> list[tuple[tuple, Any]]:
    """`(path, leaf)` for each leaf of `tree`, as `tree_flatten_with_path` gives
    them, except that the leaf a flax box or nnx Variable holds has the box's path:
    without the box's own `.value` key (`params['Dense_0']['kernel']`), which is no
    part of the model."""
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        if not is_box(node):
            out.append((path, node))
            continue
        for inner, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            own = bool(inner) and getattr(inner[0], "name", None) == "value"
            out.append((path + inner[1 if own else 0 :], leaf))
    return out


def unboxed(leaf: Any) -> Any:
    """The array a box holds (a leaf that is none, itself)."""
    if is_variable(leaf):
        return leaf.get_value()
    if is_box(leaf):
        return leaf.value
    return leaf
