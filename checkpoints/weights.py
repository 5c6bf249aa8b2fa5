"""Models from weights held in memory: a {name: array} tree (jaxgen's layout) -> a placed Transformer.

For training and RL loops in JAX: the tree is what `LLM.weights()` returns, or what
`hf.tree_from_hf` makes of a Hugging Face state dict. Arrays already laid out as the rules table
says stay where they are.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
from jaxgen.model import quant
from jaxgen.model.config import ModelConfig
from jaxgen.model.params import assemble, check_tree
from jaxgen.model.transformer import Transformer
from jaxgen.sharding.rules import param_shardings, place_tree


def from_tree(cfg: ModelConfig, tree: Mapping, dtype, *, mesh=None, quantization: str | None = None) -> Transformer:
  """A Transformer over `tree`'s arrays (checked by name, shape and dtype; float weights quantized
  where they live when `quantization="int8"`); on `mesh`, each array is placed by the rules table."""
  quant.check(quantization)
  if quantization:
    cfg = dataclasses.replace(cfg, weight_quant=quantization)
  values = check_tree(cfg, dtype, tree, source="weights")
  if mesh is not None:
    values = place_tree(values, param_shardings(cfg, dtype, mesh))
  else:
    values = {n: x if isinstance(x, jax.Array) else jax.device_put(x) for n, x in values.items()}
  return assemble(cfg, dtype, values)
