"""The command line end to end, in process, on a tiny HF fixture: `generate --json`, the streamed
`generate` with its phase report, bare options routed to `generate`, and `bench` on a tiny grid."""

from __future__ import annotations

import json
import pathlib

import pytest
from jaxgen import LLM, SamplingParams
from jaxgen.cli import main, programs_report
from jaxgen.decode import compiles
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
  # The weights it counts are the checkpoint's, read here from the safetensors file itself.
  with safe_open(str(MODEL / "model.safetensors"), "np") as f:
    checkpoint_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
  assert report["info"]["weights_bytes"] == checkpoint_bytes
  assert [r["prompt_len"] for r in report["prefill"]] == [16, 32]
  assert {r["batch"] for r in report["decode"]} == {1, 2}
  bw = report["roofline"]["mem_bw"]
  for r in report["decode"]:
    assert r["bytes_per_step"] > checkpoint_bytes  # every step reads the weights and some cache
    assert r["tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3), rel=1e-6)
    assert r["mbu"] == pytest.approx(r["bytes_per_step"] / (r["step_ms"] / 1e3) / bw, rel=1e-6)
    assert 0 < r["mbu"] < 1.5
  for r in report["prefill"]:
    assert r["tok_s"] == pytest.approx(r["prompt_len"] / r["seconds"], rel=1e-6) and 0 < r["mfu"] < 1.5


def test_bench_prefix_runs_both_scenarios_cache_off_and_on(capsys):
  assert main(["bench", *COMMON[:2], "--compilation-cache", "", "--prefix", "--quick", "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  off, on = r["prefix"]
  assert not off["prefix_caching"] and on["prefix_caching"] and off["cached_tokens"] == 0
  # 8 requests of one prefix: all but the first reuse its full blocks, so far fewer tokens prefill.
  assert on["cached_tokens"] >= 7 * (on["prefix_len"] // 16 * 16) and on["prefill_tokens"] < off["prefill_tokens"] / 4
  assert on["ttft_rest_speedup"] > 0 and on["wall_speedup"] > 0
  chat_off, chat_on = r["chat"]
  assert [t["cached_tokens"] for t in chat_off["turns"]] == [0] * 5
  assert all(t["cached_tokens"] > 0 for t in chat_on["turns"][1:])


def test_bench_speculative_with_a_draft_model_config(capsys):
  config = '{"method": "draft_model", "model": "self", "draft_layers": 1, "num_speculative_tokens": 3}'
  assert main(["bench", *COMMON[:2], "--compilation-cache", "", "--speculative", config, "--quick", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["spec"]
  assert [r["prompt"] for r in rows] == ["repeats its input", "ordinary text", "ordinary text"]
  for r in rows:  # speculation changes no token; the draft proposed and the target scored
    assert r["same_tokens"] and r["spec"]["generated"] == r["plain"]["generated"]
    assert r["spec"]["mean_accepted_length"] >= 0 and r["speedup"] > 0
  assert sum(r["spec"]["acceptance"] > 0 for r in rows) >= 1


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
