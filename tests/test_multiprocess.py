"""Two processes x 4 CPU devices, joined by `jax.distributed` (gloo), decode as one 8-device mesh.

Each process runs this file as a worker: the same prompts, the same host loop (SPMD). Process 0
returns the outputs, process 1 an empty list; the greedy tokens must equal those of one plain
process on one device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts subprocesses with 8 simulated devices

MESH = dict(data=2, model=4)
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 7], [1000, 2, 4095, 8, 16, 300, 11], [42]]
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(*args: str) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, what: str) -> dict:
  out, err = proc.communicate(timeout=TIMEOUT_S)
  if proc.returncode != 0:
    raise AssertionError(f"{what} failed (rc={proc.returncode}):\n{err[-6000:]}")
  return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
  port = str(_free_port())
  procs = {"single": _spawn("single"), 0: _spawn("worker", "0", port), 1: _spawn("worker", "1", port)}
  try:
    return {k: _result(p, f"process {k}") for k, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.communicate()


def test_two_processes_form_one_eight_device_mesh(runs):
  for pid in (0, 1):
    got = runs[pid]
    assert got["process"] == [pid, 2]
    assert got["devices"] == {"global": 8, "local": 4}
    assert got["mesh"] == MESH
    assert got["local_shards_of_embed"] == 4  # each process holds only its own devices' shards


def test_multiprocess_greedy_equals_single_process(runs):
  assert runs["single"]["tokens"]
  assert runs[0]["tokens"] == runs["single"]["tokens"]
  assert runs[1]["tokens"] == []  # only process 0 returns outputs


# ------------------------------------------------------------------------------------ the worker
def _generate(llm) -> list[list[int]]:
  from jaxgen import SamplingParams

  outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
  return [o.outputs[0].token_ids for o in outs]


def worker(pid: int | None, port: str | None) -> dict:
  if pid is not None:
    from jaxgen.sharding import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, pid, cpu_devices=4)
  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from jaxgen import LLM
  from jaxgen.sharding.mesh import MeshConfig
  from test_sharding import _tiny_cfg, _use_tiny_model

  _use_tiny_model(_tiny_cfg())
  kw = dict(max_len=64, max_batch=4, prefill_chunk=16)
  if pid is None:
    return {"tokens": _generate(LLM(None, **kw))}
  llm = LLM(None, mesh=MeshConfig(**MESH), **kw)
  return {
      "process": [jax.process_index(), jax.process_count()],
      "devices": {"global": jax.device_count(), "local": jax.local_device_count()},
      "mesh": dict(llm.mesh.shape),
      "local_shards_of_embed": len(llm.model.embed[...].addressable_shards),
      "tokens": _generate(llm),
  }


if __name__ == "__main__":
  if sys.argv[1] == "single":
    result = worker(None, None)
  else:
    result = worker(int(sys.argv[2]), sys.argv[3])
  print(json.dumps(result), flush=True)
