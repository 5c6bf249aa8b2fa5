"""Fixed shapes: sizes are padded up to a small set of buckets, so a new request compiles nothing.

Prompt chunks pad to powers of two from 16 up to the largest chunk; decode steps run over a
power-of-two number of rows up to the number of slots; `LLM.logits` pads to powers of two and
the sizes halfway between them (`half_steps`), so that a long scored prompt pays at most a third
more than its length rather than up to twice it.
"""

from __future__ import annotations


def powers_of_two(largest: int, smallest: int = 1) -> tuple[int, ...]:
  """Powers of two from `smallest` (itself included) up to `largest` (which is always included)."""
  out, b = [], smallest
  while b < largest:
    out.append(b)
    b *= 2
  return tuple(out) + (largest,)


def half_steps(largest: int, smallest: int = 1) -> tuple[int, ...]:
  """`powers_of_two` with 1.5x each power between them (16, 24, 32, 48, 64, ...), up to `largest`."""
  out = set()
  for b in powers_of_two(largest, smallest):
    out.add(b)
    if b * 3 // 2 < largest:
      out.add(b * 3 // 2)
  return tuple(sorted(out))


def bucket(n: int, sizes: tuple[int, ...]) -> int:
  """The smallest size that holds n (sizes ascending); ValueError past the largest."""
  for size in sizes:
    if size >= n:
      return size
  raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
