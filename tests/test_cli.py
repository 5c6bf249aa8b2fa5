"""The command line end to end, in process, on a tiny HF fixture: `generate --json`, the streamed
`generate` with its phase report, bare options routed to `generate`, and `bench` on a tiny grid."""

from __future__ import annotations

import json
import pathlib

import pytest
from jaxgen import LLM, SamplingParams
from jaxgen.cli import main, programs_report
from jaxgen.decode import compiles
from jaxgen.decode.prefix import BLOCK
from safetensors import safe_open

MODEL = pathlib.Path(__file__).parent / "data" / "hf" / "qwen3"
COMMON = ["--model", str(MODEL), "--max-len", "64", "--compilation-cache", ""]


@pytest.fixture(scope="module")
def reference_tokens():
  """The greedy continuation through the Python API, to hold the CLI's against."""
  llm = LLM(str(MODEL), max_len=64, max_batch=1, seed=0)
  out = llm.generate("The river bends", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)[0]
  return out.token_ids, out.text


def test_bare_options_run_generate_and_json_has_the_result(capsys, reference_tokens):
  assert main([*COMMON, "--max-tokens", "6", "--ignore-eos", "--json", "The river bends"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["prompt"] == "The river bends"
  assert (out["token_ids"], out["text"]) == reference_tokens
  assert out["finish_reason"] == "length"
  m = out["metrics"]
  assert m["prompt_tokens"] > 0 and m["generated_tokens"] == 6 and m["ttft_s"] > 0


def test_generate_streams_the_text_and_reports_each_phase(capsys, reference_tokens):
  assert main(["generate", *COMMON, "--max-tokens", "6", "--ignore-eos", "--quiet",
               "The river bends"]) == 0
  cap = capsys.readouterr()
  assert cap.out == "The river bends" + reference_tokens[1] + "\n"
  assert "[prefill]" in cap.err and "[decode] 6 tok" in cap.err and "finish_reason=length" in cap.err


def test_generate_says_where_the_programs_time_went(capsys):
  """Without --quiet: a line with the seconds spent tracing, lowering and compiling, from JAX's own
  monitoring events; each program built is looked up in the suite's compilation cache, found or
  not."""
  before, n = compiles.phases(), compiles.count()
  assert main(["generate", *COMMON, "--max-len", "48", "--max-tokens", "3", "The river bends"]) == 0
  after, built = compiles.phases(), compiles.count() - n
  line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("# programs:"))
  assert line == programs_report(after)
  assert built >= 2 and after["trace_s"] > before["trace_s"] and after["compile_s"] > before["compile_s"]  # max_len 48
  looked_up = after["cache_hits"] + after["cache_misses"] - before["cache_hits"] - before["cache_misses"]
  assert looked_up == built


def test_bad_option_values_are_errors_not_tracebacks(capsys):
  assert main([*COMMON, "--max-tokens", "0", "hi"]) == 2
  assert "SamplingParams.max_tokens=0" in capsys.readouterr().err
  assert main(["generate", "--model", str(MODEL / "missing"), "hi"]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_bench_on_a_tiny_grid(capsys):
  assert main(["bench", *COMMON[:2], "--max-len", "128", "--compilation-cache", "", "--prompt-lengths", "16,32",
               "--batches", "1,2", "--context", "32", "--quick", "--no-throughput", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  # The bytes and FLOPs a step must move are worked out here from the checkpoint file and its
  # config.json, not by bench's own functions.
  config = json.loads((MODEL / "config.json").read_text())
  with safe_open(str(MODEL / "model.safetensors"), "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  checkpoint_bytes = sum(x.nbytes for x in tensors.values())
  assert report["info"]["weights_bytes"] == checkpoint_bytes
  assert [r["prompt_len"] for r in report["prefill"]] == [16, 32]
  assert [(r["batch"], r["slots"]) for r in report["decode"]] == [(1, 2), (2, 2), (1, 1)]
  roof = report["roofline"]
  # Decode, context 32, --quick: 4 steps a run, one warm-up and 3 timed runs, so the rows hold 32
  # to 48 tokens while timed (40 in the middle); a float32 cache of K=1 kv heads of H=32, 2 layers.
  layers, kv_heads, head_dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
  kv_bytes_per_token = layers * 2 * kv_heads * head_dim * 4  # k and v, float32
  attention = report["info"]["kernels"]["attention"]
  for r in report["decode"]:
    if attention == "cpu":  # jaxgen's kernel reads the filled entries only
      assert r["bytes_per_step"] == checkpoint_bytes + r["batch"] * 40 * kv_bytes_per_token
    else:  # XLA reads whole chunks, or (plain formulation) the whole cache of max_len 512
      assert (checkpoint_bytes + r["batch"] * 32 * kv_bytes_per_token <= r["bytes_per_step"]
              <= checkpoint_bytes + r["batch"] * 512 * kv_bytes_per_token)
    assert r["mbu"] == pytest.approx(r["bytes_per_step"] / (r["step_ms"] / 1e3) / roof["mem_bw"], rel=1e-6)
    assert 0 < r["mbu"] <= 1  # measured 0.03 to 0.11: a step of a 0.45 MB model is mostly dispatch
  # Prefill FLOPs: 2 per weight of every projection (the checkpoint's 2-d tensors but the embedding)
  # per token, q.k and p.v over the t(t+1)/2 causal pairs per head and layer, the last position's logits.
  d, n, h, v = config["hidden_size"], config["num_attention_heads"], config["head_dim"], config["vocab_size"]
  weights = sum(x.size for k, x in tensors.items() if x.ndim == 2 and "embed_tokens" not in k)
  for r in report["prefill"]:
    t = r["prompt_len"]
    flops = 2 * weights * t + layers * 4 * n * h * t * (t + 1) // 2 + 2 * v * d
    assert r["mfu"] == pytest.approx(flops / r["seconds"] / roof["matmul"], rel=1e-6)
    assert 0 < r["mfu"] <= 1  # measured 0.07


def test_bench_prefix_runs_both_scenarios_cache_off_and_on(capsys):
  assert main(["bench", *COMMON[:2], "--compilation-cache", "", "--prefix", "--quick", "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  off, on = r["prefix"]
  assert not off["prefix_caching"] and on["prefix_caching"] and off["cached_tokens"] == 0
  # Token counts, not timings: without the cache every prompt token is prefilled; with it, all but
  # the first of the 8 requests reuse the prefix's full blocks, and only the rest is prefilled.
  prompt_tokens = on["requests"] * (on["prefix_len"] + on["question_len"])
  assert off["prefill_tokens"] == prompt_tokens
  assert on["cached_tokens"] == (on["requests"] - 1) * (on["prefix_len"] // BLOCK * BLOCK)
  assert on["prefill_tokens"] == prompt_tokens - on["cached_tokens"]
  chat_off, chat_on = r["chat"]
  assert [t["cached_tokens"] for t in chat_off["turns"]] == [0] * 5
  assert [t["prompt_tokens"] for t in chat_on["turns"]] == [t["prompt_tokens"] for t in chat_off["turns"]]
  for before, turn in zip(chat_on["turns"], chat_on["turns"][1:]):
    # The previous turn's prompt is a prefix of this one: at least its full blocks are reused,
    # never the last token (its logits must be computed).
    assert before["prompt_tokens"] // BLOCK * BLOCK <= turn["cached_tokens"] < turn["prompt_tokens"]
    assert turn["cached_tokens"] % BLOCK == 0


def test_bench_speculative_with_a_draft_model_config(capsys):
  config = '{"method": "draft_model", "model": "self", "draft_layers": 1, "num_speculative_tokens": 3}'
  assert main(["bench", *COMMON[:2], "--compilation-cache", "", "--speculative", config, "--quick", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["spec"]
  assert [r["prompt"] for r in rows] == ["repeats its input", "ordinary text", "ordinary text"]
  k = 3
  for r in rows:  # speculation changes no token; the draft proposed and the target scored
    assert r["same_tokens"] and r["spec"]["generated"] == r["plain"]["generated"]
    s = r["spec"]
    assert 0 <= s["acceptance"] <= 1
    # mean accepted length: 1 (the target's own token) + accepted drafts per proposing step, each
    # step proposing from 1 to k: so within [1 + acceptance, 1 + k * acceptance].
    assert 1 + s["acceptance"] - 1e-9 <= s["mean_accepted_length"] <= 1 + k * s["acceptance"] + 1e-9
  # Greedy on the prompt whose answer repeats its input, the one-layer draft of this two-layer model
  # must hit: measured acceptance 1.0 and mean accepted length 3.875 = 31 tokens / 8 steps (of at
  # most 1 + k = 4; the last step proposes fewer, max_tokens being near).
  assert rows[0]["spec"]["acceptance"] >= 0.9 and rows[0]["spec"]["mean_accepted_length"] >= 3.5


def test_quantization_and_cache_dtype_options_reach_the_engine(capsys):
  llm = LLM(str(MODEL), max_len=64, max_batch=1, seed=0, quantization="int8", cache_dtype="int8")
  want = llm.generate("The river bends", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                      use_tqdm=False)[0].token_ids
  assert main([*COMMON, "--quantization", "int8", "--cache-dtype", "int8", "--max-tokens", "6", "--ignore-eos",
               "--json", "The river bends"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["token_ids"] == want and (out["quantization"], out["cache_dtype"]) == ("int8", "int8")


def test_bad_cache_dtype_is_refused_by_name():
  with pytest.raises(ValueError, match=r"cache_dtype='int4' is not supported; use one of \['float32', 'bfloat16', 'float16', 'int8'\]"):
    LLM(str(MODEL), max_len=64, max_batch=1, cache_dtype="int4")
