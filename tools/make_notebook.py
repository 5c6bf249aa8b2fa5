"""Writes notebooks/quickstart.ipynb from the cells below (outputs stripped: git holds no outputs).

  python tools/make_notebook.py
"""

from __future__ import annotations

import pathlib

import nbformat

md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

CELLS = [
    md("""# jaxgen quickstart

jaxgen runs language models with JAX and XLA: one compiled **prefill** program reads a whole prompt
in parallel (compute-bound: it sets the time to the first token), one compiled **decode** program
makes one token for every running request (bound by memory bandwidth: it usually takes most of the
wall clock). This notebook loads the embedded model, generates, streams, batches, chats, and plots
where the time goes.

**Runs unchanged on Colab** with a CPU, GPU or TPU runtime: run the install cell first (pick the
JAX line for your runtime). On a laptop CPU everything below takes a minute or two; the first
start converts the embedded model's weights once (about 20 s), later starts read them from
`~/.cache/jaxgen` in about 2 s.

The embedded model, Gemma 3 270M, is a **base** model: it continues text rather than answering
questions. For chat, load an instruction-tuned checkpoint: `LLM("path/to/gemma-3-270m-it.gguf")`
or a Hugging Face directory."""),
    code("""# Install (Colab or a fresh environment): uncomment the lines for your runtime.
# !pip install jaxgen
# !pip install -U "jax[tpu]"      # Colab TPU runtime
# !pip install -U "jax[cuda12]"   # Colab GPU runtime
import jax

print(jax.__version__, jax.devices())"""),
    code("""from jaxgen import LLM, SamplingParams

llm = LLM(dtype="bfloat16", max_len=2304, max_batch=8)   # the embedded Gemma 3 270M
llm.timings                              # where the start-up went"""),
    md("## Generate\n\nEvery output says why it ended (`finish_reason`: `stop`, `length` or `abort`) and keeps "
       "prefill and decode apart in its metrics."),
    code("""out = llm.generate("The three most important ideas in computer science are",
                   SamplingParams(max_tokens=32, temperature=0))[0]
out"""),
    md("## Stream"),
    code("""stream = llm.stream("Once upon a time, in a small village by the sea,", SamplingParams(max_tokens=40, temperature=0.8, seed=1))
for delta in stream:
    print(delta, end="", flush=True)
print("\\n", stream.output.finish_reason)"""),
    md("## A batch with mixed sampling parameters\n\nEach request brings its own parameters; they are "
       "per-row data on the device, so all of them run in the same compiled program."),
    code("""prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
params = [SamplingParams(max_tokens=16, temperature=0),
          SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=0),
          SamplingParams(max_tokens=16, temperature=0, stop=["."]),
          SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=1, n=2)]
for o in llm.generate(prompts, params):
    for c in o.outputs:
        print(f"{c.finish_reason:>6} | {o.prompt}{c.text!r}")"""),
    md("## Chat\n\nThe prompt is rendered with the model's own chat template. A base model answers poorly "
       "(it may echo the question); an instruction-tuned checkpoint answers."),
    code("""reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(max_tokens=24, temperature=0))[0]
reply.text"""),
    md("""## Where the wall clock goes

A 2,000-token prompt with a 100-token answer: prefill handles 95% of the tokens in one parallel
pass; decode makes the other 5% one at a time, each step reading every weight."""),
    code("""import matplotlib.pyplot as plt

long_prompt = ("The history of the river is long. " * 250)[:9000]
long = llm.generate(long_prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
m = long.metrics
prefill_s, decode_s = m.ttft_s, m.decode_s
print(f"{m.prompt_tokens} prompt tokens, {m.generated_tokens} generated; "
      f"prefill {prefill_s:.2f} s, decode {decode_s:.2f} s")
fig, ax = plt.subplots(figsize=(7, 1.8))
ax.barh(["time"], [prefill_s], label=f"prefill ({m.prompt_tokens} tokens)")
ax.barh(["time"], [decode_s], left=[prefill_s], label=f"decode ({m.generated_tokens} tokens)")
ax.barh(["tokens"], [m.prompt_tokens / (m.prompt_tokens + m.generated_tokens)], label=None, color="C0")
ax.barh(["tokens"], [m.generated_tokens / (m.prompt_tokens + m.generated_tokens)],
        left=[m.prompt_tokens / (m.prompt_tokens + m.generated_tokens)], color="C1")
ax.set_xlabel("seconds (time row) / share (tokens row)")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2)
plt.show()
print(f"decode: {100 * decode_s / (prefill_s + decode_s):.0f}% of the time for "
      f"{100 * m.generated_tokens / (m.prompt_tokens + m.generated_tokens):.0f}% of the tokens")"""),
    md("""## Decode speed against batch size, with the roofline

One decode step reads every weight once, whatever the number of rows: more rows share that read.
The dashed line is the memory-bandwidth roofline measured on this device (`jaxgen bench` measures
the same way): tokens per second if every step ran at the full bandwidth."""),
    code("""from jaxgen import bench

roof = bench.roofline(llm.dtype)
rows = [r for r in bench.bench_decode(llm, [1, 2, 4, 8], context=128, steps=8, roof=roof) if r["slots"] > 1]
batches = [r["batch"] for r in rows]
measured = [r["tok_s"] for r in rows]
bound = [r["batch"] * roof["mem_bw"] / r["bytes_per_step"] for r in rows]
plt.figure(figsize=(5, 3.2))
plt.plot(batches, measured, "o-", label="measured")
plt.plot(batches, bound, "--", label="memory roofline")
plt.xscale("log", base=2); plt.xticks(batches, batches)
plt.xlabel("requests decoded together"); plt.ylabel("decode tokens / s"); plt.legend(); plt.grid(alpha=0.3)
plt.show()
for r in rows:
    print(f"batch {r['batch']}: {r['tok_s']:.0f} tok/s, MBU {100 * r['mbu']:.0f}%")"""),
    md("## The engine's own figures"),
    code("""{k: v for k, v in llm.engine.metrics().items() if k in
 ("prefill_tokens", "decode_tokens", "prefill_tok_s", "decode_tok_s", "prefix_cache_hit_rate", "decode_rows")}"""),
]


def main() -> None:
  nb = nbformat.v4.new_notebook(cells=CELLS, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"}})
  path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
  nbformat.validate(nb)
  nbformat.write(nb, path)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
