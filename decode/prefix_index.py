"""The host side of prefix caching: chained block hashes and the index of what the store holds.

No JAX here: the scheduler decides restores and saves with it, and the runner copies the blocks
(`decode.prefix` has the device side and the design).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

BLOCK = 16  # tokens per cached block


def chain(ids: Sequence[int], blocks: int) -> list[bytes]:
  """Chained hashes of the first `blocks` full blocks of token ids."""
  arr = np.asarray(ids[:blocks * BLOCK], np.int64)
  out, h = [], b""
  for i in range(blocks):
    h = hashlib.blake2b(h + arr[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
    out.append(h)
  return out


class PrefixIndex:
  """Which chained hashes the store holds, in which block, least recently used first."""

  def __init__(self, blocks: int):
    self.capacity = blocks
    self._free = list(range(blocks - 1, -1, -1))
    self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self.evictions = 0

  def __contains__(self, h: bytes) -> bool:
    return h in self._lru

  def __len__(self) -> int:
    return len(self._lru)

  def lookup(self, hashes: Sequence[bytes]) -> list[int]:
    """Store blocks of the longest cached run of `hashes` from the first (touched as used)."""
    ids = []
    for h in hashes:
      i = self._lru.get(h)
      if i is None:
        break
      ids.append(i)
    self.touch(hashes[:len(ids)])
    return ids

  def touch(self, hashes: Sequence[bytes]) -> None:
    """Marks a chain used, deepest block first: ancestors end up more recent than descendants."""
    for h in reversed(hashes):
      if h in self._lru:
        self._lru.move_to_end(h)

  def add(self, h: bytes, keep: frozenset[bytes] | set[bytes]) -> int | None:
    """A store block for new hash `h`: a free one, or the least recently used one's unless that
    is in `keep` (the chain being saved: then the store is too small for it and None is returned)."""
    if self._free:
      i = self._free.pop()
    else:
      if not self._lru:
        return None
      victim = next(iter(self._lru))
      if victim in keep:
        return None
      i = self._lru.pop(victim)
      self.evictions += 1
    self._lru[h] = i
    return i

  def check(self) -> None:
    """Every block is either free or held by exactly one hash (nothing leaked)."""
    held = list(self._lru.values())
    if sorted(held + self._free) != list(range(self.capacity)):
      raise AssertionError(f"prefix store blocks leaked: {len(held)} held + {len(self._free)} free "
                           f"!= {self.capacity}")
