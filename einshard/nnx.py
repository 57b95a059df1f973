"""Flax NNX: layouts on ``nnx.Variable`` metadata, sharded init (``import einshard.nnx as esx``; needs flax)."""

from ._src.nnx import init_function, init_sharded, layout_of, state_shardings, with_layout

__all__ = ["with_layout", "layout_of", "state_shardings", "init_function", "init_sharded"]
