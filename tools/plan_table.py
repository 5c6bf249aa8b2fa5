"""Writes the predicted-rates table of docs/accelerators.md: three models on three TPU slices,
each compiled by `jaxgen plan` (decode at every slot, prefill of the largest chunk). Needs libtpu;
takes about 20 minutes on a 2-core CPU (the TPU compiler runs here).

    python tools/plan_table.py --out table.md --json reports.json
    python tools/plan_table.py --out table.md --from-json reports.json   # re-render, no compiling
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxgen import plan, targets
from jaxgen.sharding.mesh import MeshConfig

MODELS = (("gemma3-270m (embedded)", None, 8, 2048), ("llama-3.1-8b", "llama-3.1-8b", 32, 8192),
          ("llama-3.1-70b", "llama-3.1-70b", 32, 8192))
SLICES = ("tpu-v5e-8", "tpu-v6e-8", "tpu-v5p-8")


def compile_all() -> list[plan.Report]:
  reports = []
  for label, model, slots, max_len in MODELS:
    cfg, _ = plan.model_config(model)
    for name in SLICES:
      chips = targets.TARGETS[name].chips
      # The 270M model has 4 query heads and 1 kv head: it splits by slots, not by heads.
      mesh = MeshConfig(data=chips, model=1) if model is None else None
      reports.append(plan.plan(cfg, name, model_name=label, max_batch=slots, max_len=max_len, mesh=mesh,
                               only=lambda n, s=slots: n == f"decode_{s}" or n.startswith("prefill_fresh_"),
                               largest_prefill_only=True))
      print(row(reports[-1]), flush=True)
  return reports


def from_json(path: str) -> list[plan.Report]:
  out = []
  for r in json.load(open(path)):
    fields = {f.name: r[f.name] for f in dataclasses.fields(plan.Report) if f.name in r}
    fields.setdefault("cache_bytes", r["state_bytes"])  # older reports: the sampler's few MB counted as cache
    fields["programs"] = [plan.ProgramReport(**p) for p in r["programs"]]
    out.append(plan.Report(**fields))
  return out


def row(r: plan.Report) -> str:
  pred = r.predicted()
  fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
  mesh = ",".join(f"{k}={v}" for k, v in r.mesh.items())
  failed = [p for p in r.programs if not p.compiled]
  hbm = f"{r.hbm_bytes / 2**30:.1f} / {r.hbm_capacity_bytes / 2**30:.0f} GiB {'fits' if r.fits else '**does not fit**'}"
  if failed:  # the compiler's own words (an HBM overflow names what it needed)
    hbm = f"**does not fit**: {failed[0].error.split(': ', 2)[-1]}"
  decode, prefill = pred["decode"], pred["prefill"]
  loose = "-" if decode is None else fmt(decode["compiler_bytes_tok_s"])
  return (f"| {r.model} | {r.target} ({mesh}) | {r.max_batch} x {r.max_len} | {hbm} | {fmt(pred['decode_tok_s'])} "
          f"({'-' if decode is None else decode['bound']}) | {loose} | {fmt(pred['prefill_tok_s'])} "
          f"({'-' if prefill is None else prefill['bound']}) |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--json", default=None, help="also write every report here")
  p.add_argument("--from-json", default=None, help="render reports written by --json instead of compiling")
  a = p.parse_args()
  reports = from_json(a.from_json) if a.from_json else compile_all()
  head = ["| model | slice (mesh) | slots x tokens | HBM per chip (largest program) | decode tok/s, all slots | "
          "decode by the compiler's bytes | prefill tok/s, one chunk |", "|---|---|---|---|---|---|---|"]
  with open(a.out, "w") as f:
    f.write("\n".join(head + [row(r) for r in reports]) + "\n")
  if a.json:
    with open(a.json, "w") as f:
      json.dump([r.as_json() for r in reports], f, indent=1)


if __name__ == "__main__":
  main()
