"""Fixed shapes: sizes are padded up to a small set of buckets, so a new request compiles nothing.

Prompt chunks pad to powers of two from 16 up to the largest chunk; decode steps run over a
power-of-two number of rows up to the number of slots; `LLM.logits` pads to powers of two.
"""

from __future__ import annotations


def powers_of_two(largest: int, smallest: int = 1) -> tuple[int, ...]:
  """Powers of two from `smallest` (itself included) up to `largest` (which is always included)."""
  out, b = [], smallest
  while b < largest:
    out.append(b)
    b *= 2
  return tuple(out) + (largest,)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
  """The smallest size that holds n (sizes ascending); ValueError past the largest."""
  for size in sizes:
    if size >= n:
      return size
  raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
