"""Accelerator targets that `jaxgen plan` compiles for without the hardware, and model presets.

A `Target` names a slice (`tpu-v5e-8`, `gpu-h100-8`), the topology string the compiler's plugin
understands (libtpu's `v5e:2x4`; the CUDA plugin's `1x1x8` with the card's target config), and
the chip's spec-sheet figures that turn the compiler's counts into a roofline prediction: HBM
capacity and bandwidth, and the dense bf16 matmul rate. Spec-sheet figures are upper bounds a
program approaches, never measurements; `benchmarks/accelerator.py` measures a lent device.

`MODELS` holds HF `config.json` contents of a few public architectures, so that "will this fit,
and how fast could it decode" needs neither weights nor a download: only shapes matter to a plan.
"""

from __future__ import annotations

import dataclasses

_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str  # what jax's device_kind says
  hbm_bytes: int  # per chip
  hbm_bandwidth: float  # bytes/s per chip
  bf16_flops: float  # dense FLOP/s per chip
  int8_ops: float  # dense int8 OP/s per chip (bf16's where the chip has no faster int8 path)
  platform: str = "tpu"
  target_config: str = ""  # GPUs: XLA's device description, what the compiler needs without a device


# XLA's GpuTargetConfig for an H100 SXM (132 SMs, sm_90): the figures its device query reports.
_H100_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


CHIPS = {
    "v4": Chip("TPU v4", 32 * _GIB, 1.2e12, 275e12, 275e12),
    "v5e": Chip("TPU v5 lite", 16 * _GIB, 8.19e11, 197e12, 394e12),
    "v5p": Chip("TPU v5", 95 * _GIB, 2.765e12, 459e12, 918e12),
    "v6e": Chip("TPU v6 lite", 32 * _GIB, 1.64e12, 918e12, 1836e12),
    "h100": Chip("NVIDIA H100 80GB HBM3", 84929347584, 3.35e12, 989e12, 1979e12, "cuda", _H100_CONFIG),
}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  generation: str  # a CHIPS key
  topology: str  # libtpu's topology string; one chip is the first device of `topology`
  chips: int  # chips the programs span

  @property
  def chip(self) -> Chip:
    return CHIPS[self.generation]

  @property
  def hosts(self) -> int:
    """Hosts of the slice (v5e, v6e and GPU hosts carry up to 8 chips, v4 and v5p 4)."""
    per_host = 4 if self.generation in ("v4", "v5p") else 8
    return max(1, self.chips // per_host)


def _targets() -> dict[str, Target]:
  out = {}
  for gen, shapes in (("v5e", {1: "2x2", 4: "2x2", 8: "2x4", 16: "4x4"}),
                      ("v6e", {1: "2x2", 4: "2x2", 8: "2x4", 16: "4x4"}),
                      ("v5p", {1: "2x2x1", 4: "2x2x1", 8: "2x2x2"}),
                      ("v4", {1: "2x2x1", 4: "2x2x1", 8: "2x2x2"})):
    for chips, topo in shapes.items():
      # Cloud TPU names v4 and v5p slices by TensorCores (two per chip), v5e and v6e by chips.
      cores = chips * 2 if gen in ("v4", "v5p") else chips
      name = f"tpu-{gen}-{cores}"
      out[name] = Target(name, gen, f"{gen}:{topo}", chips)
  for chips in (1, 8):
    out[f"gpu-h100-{chips}"] = Target(f"gpu-h100-{chips}", "h100", f"1x1x{chips}", chips)
  return out


TARGETS: dict[str, Target] = _targets()


def target(name: str) -> Target:
  if name not in TARGETS:
    raise ValueError(f"--target {name!r} is not known; choose one of {sorted(TARGETS)}")
  return TARGETS[name]


_LLAMA3 = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=131072, tie_word_embeddings=False,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
MODELS: dict[str, dict] = {
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8),
    "qwen3-8b": dict(model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
}
