"""`jaxgen plan`: every program an engine would run, compiled for a TPU slice or GPUs that are not here.

From a model's configuration alone (a preset, an HF `config.json`, or a GGUF file's metadata: no
weight is read or allocated) and a target slice (`targets.TARGETS`), the engine's programs are
built exactly as `decode.engine.Engine` builds them (same platform rules, cache spec, prompt and
row buckets, shardings from the rules table), traced over `ShapeDtypeStruct`s laid out on the
slice's devices (libtpu's `get_topology_desc`; for GPUs the CUDA plugin's, from the card's target
config), and compiled by the real compiler (XLA:TPU and Mosaic; XLA:GPU). What each
compile answers is reported: HBM per chip (arguments, outputs, temporaries, aliased), whether the
donated state is aliased (never copied), bytes accessed and FLOPs per step (the compiler's cost
analysis), and the collectives. From those and the chip's spec sheet comes a roofline prediction
of decode and prefill rates: a bound a real run approaches, labelled as such.

Needs libtpu (`pip install "jax[tpu]==<jax version>"`) for TPUs and the CUDA plugin for GPUs (both
in the test extra); no TPU or GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxgen import targets
from jaxgen.checkpoints import gguf, hf, source
from jaxgen.decode import speculative, structured
from jaxgen.decode.config import EngineConfig, check_sizes
from jaxgen.decode.prefix import BLOCK
from jaxgen.decode.steps import Programs, memory_plan, state_axes, state_shardings, store_shardings
from jaxgen.model import params as model_params
from jaxgen.model.config import ModelConfig
from jaxgen.model.platform import resolve
from jaxgen.sharding import rules
from jaxgen.sharding.mesh import MeshConfig

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= \(?(\w+)\[([\d,]*)\][^=]*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def model_config(model: str | None) -> tuple[ModelConfig, str]:
  """(config, where it came from) for a preset name (`targets.MODELS`), an HF `config.json` or
  directory, or a GGUF file (its metadata only); None: the embedded model."""
  if model is None:
    path = str(source.default_model_path())
    return gguf.config_from_gguf_metadata(gguf.metadata(gguf.open_reader(path))), "embedded gemma3-270m"
  if model in targets.MODELS:
    return hf.config_from_hf(targets.MODELS[model], source=model), f"preset {model}"
  if os.path.isdir(model):
    return hf.read_config(model)[1], model
  if model.endswith(".json"):
    with open(model) as f:
      return hf.config_from_hf(json.load(f), source=repr(model)), model
  if os.path.isfile(model):
    return gguf.config_from_gguf_metadata(gguf.metadata(gguf.open_reader(model)), source=repr(model)), model
  raise ValueError(f"--model {model!r} is neither a preset ({sorted(targets.MODELS)}), a config.json, an HF "
                   "directory nor a GGUF file")


def topology_devices(target: targets.Target) -> list:
  """The slice's devices as the compiler's plugin describes them (no TPU or GPU needed): libtpu
  for TPUs, the CUDA plugin with the card's target config for GPUs."""
  chip = target.chip
  try:
    if chip.platform == "tpu":
      topo = topologies.get_topology_desc(target.topology, "tpu")
    else:
      os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here, by design
      topo = topologies.get_topology_desc(platform="cuda", target_config=chip.target_config, topology=target.topology)
  except Exception as e:
    need = (f'libtpu: pip install "jax[tpu]=={jax.__version__}"' if chip.platform == "tpu" else
            f'the CUDA plugin: pip install "jax-cuda12-plugin=={jax.__version__}" "jax-cuda12-pjrt=={jax.__version__}"')
    raise RuntimeError(f"cannot describe {target.name} ({type(e).__name__}: {e}); plans for it need {need}") from e
  return list(topo.devices)[:target.chips]


@dataclasses.dataclass
class ProgramReport:
  name: str
  compiled: bool
  error: str | None = None
  hbm_bytes: int = 0  # per chip: arguments + outputs - aliased + temporaries + code
  alias_bytes: int = 0
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  bytes_accessed: float = 0.0  # per chip, the compiler's cost analysis
  flops: float = 0.0
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> count
  all_gather_bytes: int = 0  # bytes the step's all-gathers produce, per chip
  all_gather_shapes: list[list[int]] = dataclasses.field(default_factory=list)  # each all-gather's result
  compile_s: float = 0.0
  tokens: int = 0  # tokens one run of the program computes (rows of a decode step, a prompt chunk)


@dataclasses.dataclass
class Report:
  target: str
  chips: int
  mesh: dict[str, int]
  model: str
  dtype: str
  quantization: str | None
  cache_dtype: str
  max_batch: int
  max_len: int
  attention: str
  hbm_capacity_bytes: int
  planner_bytes: int
  state_bytes: int  # per chip: the donated decode state (KV cache and sampler)
  cache_bytes: int  # per chip: the KV cache
  weight_bytes: int  # per chip
  programs: list[ProgramReport]

  @property
  def hbm_bytes(self) -> int:
    """The largest program's HBM per chip."""
    return max((p.hbm_bytes for p in self.programs if p.compiled), default=0)

  @property
  def fits(self) -> bool:
    return all(p.compiled for p in self.programs) and self.hbm_bytes <= self.hbm_capacity_bytes

  def predicted(self) -> dict[str, Any]:
    """Roofline rates: a step takes at least the bytes it must move over the HBM bandwidth and its
    FLOPs (the compiler's count; 2 per weight and token on GPU, whose compiler gives none) over the
    matmul rate, at the chip's spec-sheet figures.

    Bytes a step must move, per chip: decode reads the weights and the whole KV cache (every slot
    at full length: what XLA attention reads, and the Pallas kernel's worst case); prefill reads
    the weights. The compiler's own `bytes accessed` is kept beside (`compiler_bytes_tok_s`): it
    also counts weights that XLA:TPU prefetches into VMEM (async slices, then a read from VMEM) and
    whole outputs of in-place updates, so it bounds from below, loosely."""
    chip = targets.TARGETS[self.target].chip
    peak = chip.int8_ops if self.quantization == "int8" else chip.bf16_flops

    def rate(kind: str, must_move: int):
      runs = [p for p in self.programs if p.compiled and p.name.startswith(kind)]
      if not runs:
        return None
      p = max(runs, key=lambda p: p.tokens)
      # The GPU compiler reports no cost analysis: there, 2 FLOPs per weight and token.
      weights = self.weight_bytes / (1 if self.quantization else jnp.dtype(self.dtype).itemsize)
      flops = p.flops or 2.0 * p.tokens * weights
      memory, compute = must_move / chip.hbm_bandwidth, flops / peak
      step = max(memory, compute)
      loose = max(p.bytes_accessed / chip.hbm_bandwidth, compute)
      return dict(program=p.name, tokens_per_step=p.tokens, bytes_per_step=must_move, flops_per_step=flops,
                  step_s=step, bound="memory" if memory >= compute else "compute", tok_s=p.tokens / step,
                  compiler_bytes_tok_s=p.tokens / loose)

    decode = rate("decode", self.weight_bytes + self.cache_bytes)
    prefill = rate("prefill_fresh", self.weight_bytes)
    return dict(decode_tok_s=decode and decode["tok_s"], prefill_tok_s=prefill and prefill["tok_s"],
                decode=decode, prefill=prefill,
                basis=(f"roofline prediction, not a measurement: per step and chip, max(bytes / "
                       f"{chip.hbm_bandwidth / 1e9:.0f} GB/s, FLOPs / {peak / 1e12:.0f} TFLOP/s), spec-sheet "
                       f"{chip.kind} figures; bytes: the weights, plus for decode the whole KV cache; FLOPs: the "
                       "compiler's cost analysis (GPU: 2 per weight and token)"))

  def as_json(self) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(self).items() if k != "programs"}
    out.update(fits=self.fits, hbm_bytes=self.hbm_bytes, predicted=self.predicted(),
               programs=[dataclasses.asdict(p) for p in self.programs])
    return out

  def __str__(self) -> str:
    gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    lines = [f"{self.model} on {self.target} ({self.chips} chips, mesh {mesh}), {self.dtype}"
             f"{' int8 weights' if self.quantization else ''}, cache {self.cache_dtype}, {self.max_batch} slots x "
             f"{self.max_len} tokens, attention {self.attention}",
             f"{'program':<22}{'HBM/chip':>11}{'aliased':>11}{'GB moved':>10}{'GFLOP':>10}  collectives   compile",
             ]
    for p in self.programs:
      if not p.compiled:
        lines.append(f"{p.name:<22}  FAILED: {p.error}")
        continue
      coll = ",".join(f"{k}:{v}" for k, v in p.collectives.items() if v) or "-"
      lines.append(f"{p.name:<22}{gib(p.hbm_bytes):>11}{gib(p.alias_bytes):>11}{p.bytes_accessed / 1e9:>10.2f}"
                   f"{p.flops / 1e9:>10.1f}  {coll:<12}{p.compile_s:>7.1f}s")
    pred = self.predicted()
    lines += [f"HBM per chip: largest program {gib(self.hbm_bytes)} of {gib(self.hbm_capacity_bytes)} "
              f"({'fits' if self.fits else 'DOES NOT FIT'}); memory planner {gib(self.planner_bytes)}",
              f"predicted decode {_rate(pred['decode_tok_s'])} tok/s at {self.max_batch} rows, prefill "
              f"{_rate(pred['prefill_tok_s'])} tok/s ({pred['basis']})"]
    return "\n".join(lines)


def _rate(x) -> str:
  return "-" if x is None else f"{x:,.0f}"


def plan(cfg: ModelConfig, target: str | targets.Target, *, model_name: str = "", dtype: str = "bfloat16",
         quantization: str | None = None, cache_dtype: str | None = None, max_batch: int = 8,
         max_len: int = 2048, mesh: MeshConfig | None = None, attention_impl: str = "auto",
         speculative_config=None, prefix_caching: bool = True,
         only: Callable[[str], bool] | None = None, largest_prefill_only: bool = False) -> Report:
  """Compiles the engine's programs for `target` and reports what the compiler says.

  mesh: default, every chip on the `model` axis (tensor parallel). only: which programs to
  compile, by name (default all; the names are those `program_args` lists). largest_prefill_only:
  of the prompt buckets, only the largest chunk's (what a roofline prediction of prefill reads).
  A program's HBM counts the arrays resident beside its arguments (the prefix store).
  """
  tgt = targets.target(target) if isinstance(target, str) else target
  check_sizes(cfg, max_batch, max_len)  # before any device is described
  devices = topology_devices(tgt)
  mesh = (mesh or MeshConfig(data=1, model=-1)).build(devices)
  if quantization is not None:
    cfg = dataclasses.replace(cfg, weight_quant=quantization)
  platform = resolve(dtype, cache_dtype=cache_dtype, devices=tgt.chips, attention=attention_impl,
                     quantization=quantization, backend="tpu" if tgt.chip.platform == "tpu" else "gpu",
                     device_kind=tgt.chip.kind)
  spec_cfg = speculative.parse(speculative_config)
  settings = dict(max_batch=max_batch, max_len=max_len, platform=platform, mesh=mesh, speculative_config=spec_cfg,
                  enable_prefix_caching=prefix_caching)
  config = EngineConfig.resolve(cfg, dtype, **settings)
  weight_dtype = jnp.dtype(dtype)
  pl = memory_plan(cfg, weight_dtype, config.cache, mesh, capacity=tgt.chip.hbm_bytes)
  if config.store is not None and tgt.chips == 1:  # the store's default share of what one chip has free
    config = EngineConfig.resolve(cfg, dtype, **settings, free_bytes=tgt.chip.hbm_bytes - pl.total)
  spec = config.cache
  graphdef, abstract = nnx.split(model_params.abstract_model(cfg, weight_dtype))
  p_sh = rules.param_tree(abstract, rules.param_shardings(cfg, weight_dtype, mesh))
  shardings = dict(params=p_sh, state=state_shardings(cfg, spec, mesh))
  if config.store is not None:
    shardings["store"] = store_shardings(cfg, config.store, mesh)
    pl = memory_plan(cfg, weight_dtype, spec, mesh, capacity=tgt.chip.hbm_bytes, store=config.store)
  programs = Programs(graphdef, cfg, spec, config.platform, shardings)
  abstract_params = _abstract(abstract, p_sh)
  state = _abstract(state_axes(cfg, spec)[0], shardings["state"])
  store = None if config.store is None else _abstract(config.store.shapes(cfg), shardings["store"])
  reports = []
  for name, fn, args, tokens in program_args(config, programs, abstract_params, state, store):
    if only is not None and not only(name):
      continue
    if largest_prefill_only and name.startswith("prefill") and tokens != config.chunk:
      continue
    report = _compile(name, fn, args, tokens)
    if store is not None and report.compiled and not any(a is store for a in args):
      report.hbm_bytes += pl.prefix_store
    reports.append(report)
  state_bytes = pl.kv_cache + pl.sampler
  return Report(tgt.name, tgt.chips, dict(mesh.shape), model_name, dtype, quantization, spec.dtype, max_batch,
                max_len, platform.attention, tgt.chip.hbm_bytes, pl.total, state_bytes, pl.kv_cache, pl.weights,
                reports)


def _abstract(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def program_args(config: EngineConfig, programs: Programs, params, state, store):
  """(name, jitted program, abstract arguments, tokens one run computes) for every program of
  `config.programs` (what `Engine.warmup()` builds), in its order and with its shapes."""
  mesh = config.mesh
  rep = None if mesh is None else NamedSharding(mesh, P())
  arr = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
  i32, flag = functools.partial(arr, jnp.int32), arr(jnp.bool_)
  row = jax.tree.map(lambda a: arr(a.dtype, 1, *a.shape[1:]), state.sampler.params)
  words = structured.words(config.model.vocab_size)
  masks = lambda r: (i32(r, words), arr(jnp.bool_, r))  # noqa: E731  (grammar masks, rows constrained)
  k = 0 if config.speculative is None else config.speculative.k
  save_blocks, restore_blocks = config.save_blocks, config.restore_blocks
  for name, *shape in config.programs:
    if name == "prefill":
      fresh, b = shape
      yield (f"prefill_{'fresh' if fresh else 'more'}_{b}", programs.prefill_program(fresh),
             (params, state, i32(1, b), i32(1), i32(1), row), b)
    elif name == "decode":
      r = shape[0]
      yield f"decode_{r}", programs.decode, (params, state, arr(jnp.bool_, r)), r
    elif name == "sample":
      r = shape[0]
      yield (f"sample_{r}", programs.sample,
             (state, arr(jnp.float32, r, config.model.vocab_size), i32(r), arr(jnp.bool_, r), flag, *masks(r)), 0)
    elif name == "fork":
      yield "fork", programs.fork, (state, i32(), i32(), row, i32()), 0
    elif name == "move":
      yield "move", programs.move, (state, i32(), i32()), 0
    elif name == "logits":
      yield f"logits_{shape[0]}", programs.logits, (params, i32(1, shape[0])), shape[0]
    elif name == "verify":
      r = shape[0]
      yield (f"verify_{r}", programs.verify, (params, state, arr(jnp.bool_, r), i32(r, k), i32(r), flag,
                                              i32(r * (k + 1), words), arr(jnp.bool_, r)), r * (k + 1))
    elif name == "save":
      yield "prefix_save", programs.save, (state, store, i32(), i32(), i32(save_blocks)), 0
    elif name == "restore":
      yield "prefix_restore", programs.restore, (state, store, i32(), i32(restore_blocks), i32(),
                                                 i32(restore_blocks * BLOCK)), 0


def _compile(name: str, fn, args, tokens: int) -> ProgramReport:
  t0 = time.perf_counter()
  try:
    # Where a process has JAX's persistent cache on, an executable for a described topology is
    # written there but cannot be read back (loading needs a client of that platform): JAX warns
    # and compiles, which is what a plan does anyway.
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
      compiled = fn.lower(*args).compile()
  except Exception as e:  # the compiler's refusal is the answer, not a crash of the plan
    msg = str(e).strip().splitlines()
    return ProgramReport(name, False, f"{type(e).__name__}: {msg[0] if msg else ''}"[:500],
                         compile_s=time.perf_counter() - t0, tokens=tokens)
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older jax: one dict per computation
    cost = cost[0] if cost else {}
  collectives = dict.fromkeys(COLLECTIVES, 0)
  gathered, shapes = 0, []
  for dtype, dims, kind in _COLLECTIVE.findall(compiled.as_text()):
    collectives[kind] += 1
    if kind == "all-gather":
      shape = [int(d) for d in filter(None, dims.split(","))]
      shapes.append(shape)
      n = 1
      for d in shape:
        n *= d
      gathered += n * _itemsize(dtype)
  hbm = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
         + mem.generated_code_size_in_bytes)
  return ProgramReport(name, True, None, int(hbm), int(mem.alias_size_in_bytes), int(mem.argument_size_in_bytes),
                       int(mem.output_size_in_bytes), int(mem.temp_size_in_bytes),
                       float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0)), collectives, gathered,
                       shapes, time.perf_counter() - t0, tokens)


def _itemsize(hlo_dtype: str) -> int:
  sizes = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
           "f64": 8, "s64": 8, "u64": 8}
  return sizes.get(hlo_dtype, 4)
