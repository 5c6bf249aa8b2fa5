"""Multi-host setup on JAX's own multi-controller runtime (`jax.distributed`).

Every process runs the same program on the same inputs (SPMD): the same prompts, the same
sampling parameters, the same host loop. The mesh spans the devices of all processes; the
compiled programs exchange data among them, and only process 0 prints or returns outputs.

Call `initialize` first, before anything touches a device. With no arguments JAX detects the
cluster itself (Cloud TPU slices, SLURM, Open MPI); elsewhere give all three of the coordinator
address, the number of processes and this process's id. See docs/sharding.md for launch commands.
"""

from __future__ import annotations

import jax


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, cpu_devices: int | None = None) -> None:
  """Joins this process to the others. `cpu_devices`: CPU devices per process (for tests on CPU)."""
  given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
  if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    raise ValueError(f"distributed setup got {', '.join(k for k, v in given.items() if v is not None)} but not "
                     f"{', '.join(missing)}: give all three (e.g. --coordinator 10.0.0.2:1234 --num-processes 2 "
                     "--process-id 0) or none, to let JAX detect the cluster")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
  if jax.distributed.is_initialized():
    return
  # CPU devices of different processes exchange data through gloo (TPU/GPU use their own links).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def is_main() -> bool:
  """True in the process that prints and returns outputs (process 0)."""
  return jax.process_index() == 0


def same_seed(seed: int) -> int:
  """Process 0's `seed`, on every process: host-side randomness must agree across processes."""
  if jax.process_count() == 1:
    return seed
  import numpy as np
  from jax.experimental import multihost_utils

  # Two 32-bit halves: a 64-bit value would not survive JAX's default 32-bit mode.
  halves = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
  hi, lo = (int(x) for x in multihost_utils.broadcast_one_to_all(halves))
  return (hi << 32) | lo
