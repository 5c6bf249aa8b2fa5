"""Pallas kernels for accelerators: ragged attention over a KV cache, streamed block by block.

`cache_attention` folds each batch row's cached keys into a running softmax and reads only that
row's filled entries, as ragged paged attention does on TPU. The grid is (batch row, kv head,
cache block): the cache is streamed through VMEM in blocks of `BLOCK` entries by BlockSpecs
(Pallas double-buffers them), and the running state lives in the output blocks, which stay
resident across the block axis. Scalars prefetched to SMEM (each row's cache row, the tokens it
held and the entries it reads) pick the blocks: a block past a row's length maps to the row's
last block, which Pallas does not fetch again, and its compute is skipped. So a step reads what
its rows hold, not what the cache could.

Positions are not read from memory: entry j of a global layer holds position j; entry j of a
ring of W holds the latest p < length with p % W == j (`model.kv`). They are computed in the
kernel from the row's length (scalar arithmetic on the scalar core, one compare per entry), which
also keeps every block shape one Mosaic accepts: the last two dimensions of a block are whole, or
multiples of (8, 128).

Grouped-query heads (the G query heads and T queries of one kv head are one matmul's rows),
sliding-window rings, soft-capping and an int8 cache with its block scales are handled. Its
reference is `attention.attention_xla`; `attention.attention_pallas` is the entry point behind the
kernel interface. On CPU it runs in Pallas' interpret mode (for tests); `jaxgen plan` compiles it
for TPU with libtpu.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxgen.model.kernels.attention import pallas_gpu
from jaxgen.model.kernels.attention.block import capped, held_position, ungroup
from jaxgen.model.kernels.attention.xla_cpu import unlimited_first
from jaxgen.model.layers import NEG_INF

BLOCK = 128  # cache entries per grid step: a multiple of every dtype's sublane tile (int8: 32)


def _kernel(rows_ref, start_ref, length_ref, q_pos_ref, q_ref, k_ref, v_ref, *refs, block: int, ring: int | None,
            window: int | None, softcap: float | None, quantized: bool):
  """One (row b, kv head, cache block c) step: fold the block's visible entries into the state."""
  if quantized:
    ks_ref, vs_ref, m_in, l_in, acc_in, m_ref, l_ref, acc_ref = refs
  else:
    (m_in, l_in, acc_in, m_ref, l_ref, acc_ref), ks_ref, vs_ref = refs, None, None
  b, c = pl.program_id(0), pl.program_id(2)

  @pl.when(c == 0)
  def _():
    m_ref[...], l_ref[...], acc_ref[...] = m_in[...], l_in[...], acc_in[...]

  length = length_ref[b]  # entries this row reads

  @pl.when(c * block < length)
  def _():
    n = start_ref[b]  # tokens the row held: entry positions follow from it

    q = q_ref[0, 0]  # [R, H]
    q_pos = q_pos_ref[0]  # [R, 1]
    k, v = k_ref[0, 0], v_ref[0, 0]  # [C, H]
    if quantized:
      k, v = _dequantize(k, ks_ref[0, 0], q.dtype), _dequantize(v, vs_ref[0, 0], q.dtype)
    s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [R, C]
    s = capped(s, softcap)
    j = c * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    k_pos = held_position(j, n, ring)  # [1, C]
    visible = (k_pos >= 0) & (k_pos <= q_pos) & (j < length)
    if window is not None:
      visible &= q_pos - k_pos < window
    s = jnp.where(visible, s, NEG_INF)
    # Entries past the row's length, or past the array's end in a last partial block, hold
    # anything (not necessarily finite): zero them so that 0 * inf cannot reach the sum.
    j_col = c * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    v = jnp.where(j_col < length, v.astype(q.dtype), 0)
    m_prev = m_ref[0, 0]  # [R, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m_prev - m_new)
    pv = jax.lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    acc_ref[0, 0] = acc_ref[0, 0] * scale + pv
    l_ref[0, 0] = l_ref[0, 0] * scale + jnp.sum(p, axis=-1, keepdims=True)
    m_ref[0, 0] = m_new


def _dequantize(x, scale, dtype):
  """int8 x [C, H] with float32 scales [C, H / Q] per block of Q lanes -> [C, H] in dtype. The
  scales are widened by a 0/1 matmul (a lane-splitting reshape is not a layout Mosaic takes)."""
  groups, h = scale.shape[-1], x.shape[-1]
  lane = jax.lax.broadcasted_iota(jnp.int32, (groups, h), 1)
  group = jax.lax.broadcasted_iota(jnp.int32, (groups, h), 0)
  widen = (jax.lax.div(lane, np.int32(h // groups)) == group).astype(jnp.float32)  # [H / Q, H]
  wide = jax.lax.dot_general(scale, widen, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return (x.astype(jnp.float32) * wide).astype(dtype)


def cache_attention(run, qg, k, v, q_pos, start, length, rows, *, ring: int | None, window: int | None,
                    softcap: float | None, k_scale=None, v_scale=None, interpret: bool = False):
  """Folds each row's cache entries [0, length[b]) into the running softmax state.

  run: (m [B, K, R, 1], l [B, K, R, 1], acc [B, K, R, H]) float32; qg: [B, K, R, H] grouped
  queries; k, v: [B', K, S, H] (int8 with k_scale, v_scale [B', K, S, H / Q]); q_pos: [B, R] each
  query row's position; start: [B] tokens each row held (its entries' positions follow, `ring`
  the ring's size or None for a global layer); length: [B] entries to read (<= S); rows: [B] the
  cache row of each batch row. -> the new (m, l, acc).
  """
  b, kh, r, h = qg.shape
  size = k.shape[2]
  block = size if size <= BLOCK else BLOCK  # a whole small layer is one block
  blocks = pl.cdiv(size, block)
  quantized = k_scale is not None

  def cache_block(i, j, c, rows_ref, start_ref, length_ref):
    # Past the row's length: its last block again (not fetched twice; its compute is skipped).
    last = jnp.maximum(pl.cdiv(length_ref[i], block) - 1, 0)
    return rows_ref[i], j, jnp.minimum(c, last), 0

  state = lambda *tail: pl.BlockSpec((1, 1) + tail, lambda i, j, c, *_: (i, j, 0, 0))  # noqa: E731
  in_specs = [pl.BlockSpec((1, r, 1), lambda i, j, c, *_: (i, 0, 0)),  # query positions [B, R, 1]
              state(r, h),
              pl.BlockSpec((1, 1, block, h), cache_block), pl.BlockSpec((1, 1, block, h), cache_block)]
  scales = []
  if quantized:
    g = k_scale.shape[-1]
    in_specs += [pl.BlockSpec((1, 1, block, g), cache_block)] * 2
    scales = [k_scale, v_scale]
  in_specs += [state(r, 1), state(r, 1), state(r, h)]
  kernel = functools.partial(_kernel, block=block, ring=ring, window=window, softcap=softcap, quantized=quantized)
  itemsize = jnp.dtype(k.dtype).itemsize
  read = min(b, k.shape[0])  # rows read at most (per shard: those it holds)
  cost = pl.CostEstimate(flops=4 * read * kh * r * size * h, transcendentals=read * kh * r * size,
                         bytes_accessed=2 * read * kh * size * h * itemsize + qg.size * qg.dtype.itemsize)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, kh, blocks), in_specs=in_specs,
          out_specs=[state(r, 1), state(r, 1), state(r, h)]),
      out_shape=[jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32), jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, r, h), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=cost,
      interpret=interpret,
  )(rows.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32), q_pos[..., None].astype(jnp.int32),
    qg, k, v, *scales, *run)


def attention_pallas(q, blocks, q_pos, window, softcap, platform=None):
  """Cache blocks through the Pallas kernel, each row read up to its own filled length
  (`cache_attention`, positions computed from `start`); the other blocks as the
  reference reads them. Interpret mode on CPU. Over several devices, the kernel runs per shard
  (`sharded_cache_attention`)."""
  b, t, n, h = q.shape
  kh, scores, weighted, run, qg, q_rows = unlimited_first(q, blocks, q_pos, window, softcap)
  # Pallas compiles only for TPU and GPU; the platform says which the program is for (a plan
  # compiles for a TPU from a CPU process).
  backend = jax.default_backend() if platform is None or platform.backend == "any" else platform.backend
  interpret = backend not in ("tpu", "gpu", "cuda") or (platform is not None and platform.emulated)
  kernel_mesh = None if platform is None else platform.kernel_mesh
  if kernel_mesh is None and platform is not None and platform.devices > 1:
    raise ValueError(f"attention_impl='pallas' over {platform.devices} devices needs Platform.kernel_mesh (how the "
                     "cache splits over the mesh; EngineConfig.resolve sets it): a kernel is not partitioned by XLA")
  for blk in blocks:
    if blk.limit is None:
      continue
    if blk.start is None:
      raise ValueError("attention_impl='pallas' reads cache blocks made by kv.held: their positions follow from "
                       "each row's length (KVBlock.start), which this block does not carry")
    size = blk.k.shape[2] if blk.ring is None else blk.ring
    length = jnp.minimum(jnp.minimum(blk.start, size), blk.limit).astype(jnp.int32)  # [B] entries to read
    rows = jnp.arange(b, dtype=jnp.int32) if blk.rows is None else blk.rows.astype(jnp.int32)
    if backend in ("gpu", "cuda"):
      if blk.k_scale is not None:
        raise ValueError("attention_impl='pallas' on GPU reads a float cache; an int8 cache takes attention_impl='xla'")
      kernel = functools.partial(pallas_gpu.cache_attention_gpu, ring=blk.ring, window=window, softcap=softcap,
                                 interpret=interpret)
    else:
      kernel = functools.partial(cache_attention, ring=blk.ring, window=window, softcap=softcap, interpret=interpret)
    if kernel_mesh is None:
      run = kernel(run, qg, blk.k, blk.v, q_rows, blk.start, length, rows, k_scale=blk.k_scale, v_scale=blk.v_scale)
    else:
      cached = sharded_cache_attention(kernel, kernel_mesh, qg, blk, q_rows, length, rows)
      run = merge(run, cached)
  return ungroup(run[2] / run[1], q)


def empty_state(qg):
  """The running softmax state of no key: (m [B, K, R, 1], l, acc [B, K, R, H]) float32."""
  b, kh, r, h = qg.shape
  return (jnp.full((b, kh, r, 1), NEG_INF, jnp.float32), jnp.zeros((b, kh, r, 1), jnp.float32),
          jnp.zeros((b, kh, r, h), jnp.float32))


def merge(x, y):
  """Two running softmax states over disjoint keys -> the state over both. NEG_INF is finite, so
  two empty states merge to an empty one (no inf - inf)."""
  (m1, l1, a1), (m2, l2, a2) = x, y
  m = jnp.maximum(m1, m2)
  s1, s2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
  return m, l1 * s1 + l2 * s2, a1 * s1 + a2 * s2


def sharded_cache_attention(kernel, kernel_mesh, qg, blk, q_rows, length, rows):
  """`kernel` (a bound `cache_attention`) per shard of a mesh: the cache's kv heads split over
  `kernel_mesh.heads` (each shard folds its heads' queries), its rows (slots) over
  `kernel_mesh.rows`. A batch row may read a cache row that another rows-shard holds: each shard
  folds the rows it holds (the others read length 0: no block is computed) into an empty state,
  and the shards' states are merged with one max and two sums over the rows axis, [B, K, R, H]
  floats per layer (the cache itself never moves). Returns the state over the block's keys."""
  rows_axis, heads_axis = kernel_mesh.rows, kernel_mesh.heads
  cache_spec = P(rows_axis, heads_axis, None, None)
  state_spec = P(None, heads_axis, None, None)
  quantized = blk.k_scale is not None

  def local(qg, q_rows, start, length, rows, k, v, *scales):
    if rows_axis is not None:
      per = k.shape[0]
      rows = rows - jax.lax.axis_index(rows_axis) * per
      here = (rows >= 0) & (rows < per)
      length = jnp.where(here, length, 0)
      rows = jnp.clip(rows, 0, per - 1)
    k_scale, v_scale = scales if quantized else (None, None)
    m, l, acc = kernel(empty_state(qg), qg, k, v, q_rows, start, length, rows, k_scale=k_scale, v_scale=v_scale)
    if rows_axis is not None:
      top = jax.lax.pmax(m, rows_axis)
      scale = jnp.exp(m - top)
      m, l, acc = top, jax.lax.psum(l * scale, rows_axis), jax.lax.psum(acc * scale, rows_axis)
    return m, l, acc

  scales = (blk.k_scale, blk.v_scale) if quantized else ()
  in_specs = (state_spec, P(), P(), P(), P()) + (cache_spec,) * (2 + len(scales))
  fn = jax.shard_map(local, mesh=kernel_mesh.mesh, in_specs=in_specs, out_specs=(state_spec,) * 3, check_vma=False)
  return fn(qg, q_rows, blk.start.astype(jnp.int32), length, rows, blk.k, blk.v, *scales)
