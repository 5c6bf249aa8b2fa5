"""`BatchMeta`: what a model call needs to know about each of its B batch rows besides the tokens.

The decoder knows nothing of requests, slots or meshes; the engine's runner says, per call, which
cache row each batch row is, how many tokens it held and how many it takes. It is the one place a
per-row feature adds what the programs need (an adapter id for multi-LoRA, a token mask for
structured output): a field here, filled by the runner from the scheduler's decision.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class BatchMeta(NamedTuple):
  """Which cache rows a layer call reads and extends, and how far."""

  start: jax.Array  # [B] int32: tokens each row held before this call
  count: jax.Array  # [B] int32: new tokens each row takes (the rest of T is padding)
  index: jax.Array | None = None  # [B] int32: the cache row of each batch row; None: rows 0..B-1
  fresh: bool = False  # static: the rows start empty (a first prompt chunk reads nothing back)
