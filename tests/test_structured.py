"""Structured output: the packed token mask on the device, and the embedded model held to JSON
schemas, regexes, choices and grammars through the engine (validated by `jsonschema` and `re`,
independent of llguidance), beside unconstrained rows that stay token for token what they were."""

import json
import re

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from conftest import DATA, ToyTokenizer, tiny_config, tiny_model
from jaxgen import SamplingParams
from jaxgen.decode.engine import Engine
from jaxgen.decode import compiles, sampling, structured
from jaxgen.decode.structured import StructuredOutputsParams as SO
from jaxgen.model.layers import NEG_INF

CASES = json.loads((DATA / "structured_schemas.json").read_text())
REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(, [A-Z][a-z]{2,9} [0-9]{1,3}){0,3}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------ no model needed
@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag (got none)"),
    ({"regex": "a+", "choice": ["a"]}, "(got regex, choice)"),
    ({"choice": "abc"}, "must be a non-empty list"),
    ({"choice": ["a", ""]}, "must be a non-empty list of non-empty strings"),
    ({"json": 3}, "give a JSON schema"),
    ({"json": "{not json"}, "StructuredOutputsParams.json is not valid JSON"),
    ({"regex": ""}, "StructuredOutputsParams.regex=''"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
])
def test_a_constraint_names_what_is_wrong(fields, message):
  with pytest.raises(ValueError) as e:
    SO(**fields)
  assert message in str(e.value)


def test_sampling_params_take_a_dict_and_refuse_unknown_fields():
  assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
  with pytest.raises(ValueError, match=r"unknown fields \['schema'\]"):
    SamplingParams(structured_outputs={"schema": {}})
  with pytest.raises(ValueError, match="SamplingParams.structured_outputs=.*must be a StructuredOutputsParams"):
    SamplingParams(structured_outputs=["json"])


def test_the_unpacked_mask_is_llguidance_own_reading():
  """`sampling.unpack_mask` against llguidance's numpy kernel, on random words and a vocabulary
  that is not a multiple of 32."""
  rng = np.random.default_rng(0)
  v = 1000
  mask = rng.integers(-2**31, 2**31, size=(3, (v + 31) // 32), dtype=np.int64).astype(np.int32)
  want = np.zeros((3, v), np.float32)
  llg_numpy.apply_token_bitmask_inplace(want, mask)
  got = np.asarray(sampling.unpack_mask(jnp.asarray(mask), v))
  np.testing.assert_array_equal(got, np.isfinite(want))
  assert 0 < got.sum() < got.size


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_draw_only_allowed_tokens_and_others_are_untouched(temperature):
  rng = np.random.default_rng(1)
  b, v = 4, 3000
  logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
  allowed = [rng.choice(v, size=5, replace=False), None, np.array([17]), None]
  mask = np.zeros((b, (v + 31) // 32), np.int32)
  bits = np.zeros((b, mask.shape[1] * 32), np.uint8)
  for r, ids in enumerate(allowed):
    if ids is not None:
      bits[r, ids] = 1
  mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
  constrained = np.array([ids is not None for ids in allowed])
  state = sampling.idle_rows(b, v)
  state = state.replace(params=state.params.replace(temperature=jnp.full((b,), temperature, jnp.float32)))
  for pos in range(8):
    positions = jnp.full((b,), pos, jnp.int32)
    plain = sampling.sample(logits, state, positions, jnp.bool_(True))
    got = sampling.sample(logits, state, positions, jnp.bool_(True), mask=jnp.asarray(mask),
                          constrained=jnp.asarray(constrained))
    tokens = np.asarray(got.tokens)
    assert tokens[0] in allowed[0] and tokens[2] == 17
    assert tokens[1] == int(plain.tokens[1]) and tokens[3] == int(plain.tokens[3])
    # Logprobs stay those of the raw distribution (vLLM's default), constrained or not.
    np.testing.assert_allclose(np.asarray(got.top_logprobs), np.asarray(plain.top_logprobs))
  if temperature == 0:
    masked = np.where(bits[0, :v] == 1, np.asarray(logits[0]), NEG_INF)
    assert tokens[0] == int(np.argmax(masked))


# ------------------------------------------------------------------------------ the embedded model
def _generate(llm, prompts, params):
  return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_each_kind_holds_beside_plain_rows_in_one_program_per_row_count(llm):
  """JSON schema, json_object, regex, choice (sampled, n=3) and a GBNF grammar, in one batch with
  two unconstrained rows: each constrained output parses as asked and ends with "stop" when its
  structure is complete; the unconstrained rows, one greedy and one seeded, equal the same
  requests run alone token for token. Masks are data: the sampler has one program per row count,
  constrained or not."""
  plain_prompts = ["The capital of France is", "def fibonacci(n):"]
  greedy = SamplingParams(max_tokens=24, temperature=0.0)
  seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=11)
  alone = _generate(llm, plain_prompts, [greedy, seeded])
  cases = [
      ("Describe a person named Ann, aged 31, as JSON:", SO(json=PERSON)),
      ("A JSON object:", SO(json_object=True)),
      ("Call me at", SO(regex=r"\(\d{3}\) \d{3}-\d{4}")),
      ("My favourite colour is", SO(choice=["red", "green", "blue"])),
      ("Is the sky blue? Answer:", SO(grammar='root ::= " " ("yes" | "no") "."')),
  ]
  params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so) for _, so in cases]
  params[3] = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, structured_outputs=cases[3][1])
  outs = _generate(llm, [p for p, _ in cases] + plain_prompts, params + [greedy, seeded])
  person, obj, number, colours, answer, *plain = outs
  jsonschema.validate(json.loads(person[0].text), PERSON)
  assert isinstance(json.loads(obj[0].text), dict)
  assert re.fullmatch(cases[2][1].regex, number[0].text), number[0].text
  assert len(colours) == 3 and all(c.text in ("red", "green", "blue") for c in colours), colours
  assert answer[0].text in (" yes.", " no.")
  for o in (person, obj, number, colours, answer):
    assert all(c.finish_reason == "stop" for c in o), [(c.text, c.finish_reason) for c in o]
  for got, want in zip(plain, alone):
    assert got[0].token_ids == want[0].token_ids
  # The engine's own sampling program of each row count, then the same with every row held to a
  # mask that allows token 0 alone (the logits favour token 5): nothing compiles for the mask.
  runner, v = llm.engine.runner, llm.cfg.vocab_size
  place = runner.grammar.place
  logits = np.zeros((max(llm.engine.config.row_buckets), v), np.float32)
  logits[:, 5] = 100.0  # whatever temperature a slot last held
  for r in llm.engine.config.row_buckets:
    def inputs():
      return place(logits[:r]), np.arange(r, dtype=np.int32), place(np.zeros(r, np.bool_)), np.bool_(False)
    runner.state, free = runner.programs.sample(runner.state, *inputs(), *runner.grammar.unconstrained(r, r))
    assert np.asarray(free.tokens).tolist() == [5] * r
    before = compiles.count()
    only_zero = np.zeros((r, structured.words(v)), np.int32)
    only_zero[:, 0] = 1
    runner.state, out = runner.programs.sample(runner.state, *inputs(), place(only_zero), place(np.ones(r, np.bool_)))
    assert compiles.count() == before and np.asarray(out.tokens).tolist() == [0] * r


@pytest.mark.slow
def test_outputs_sampled_at_temperature_one_are_valid(llm):
  """The five schemas of tests/data/structured_schemas.json (nested objects, lists with bounds,
  enums, patterns, optional fields, bounded numbers), a regex and a choice, each sampled at
  temperature 1.0 with four seeds: every output parses and validates. (benchmarks/structured.py
  runs 100 seeds of each: docs/performance.md.)"""
  seeds = range(4)
  prompts, params, checks = [], [], []
  for case in CASES.values():
    for seed in seeds:
      prompts.append(case["prompt"])
      params.append(SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                   structured_outputs=SO(json=case["schema"])))
      checks.append(lambda text, schema=case["schema"]: jsonschema.validate(json.loads(text), schema))
  for seed in seeds:
    prompts += ["Cities and their sizes:", "Which way?"]
    params += [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured_outputs=SO(regex=REGEX)),
               SamplingParams(max_tokens=8, temperature=1.0, seed=seed,
                              structured_outputs=SO(choice=["north", "south", "east", "west"]))]
    checks += [lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} does not match"),
               lambda text: text in ("north", "south", "east", "west") or pytest.fail(f"{text!r} is no choice")]
  for prompt, out, check in zip(prompts, _generate(llm, prompts, params), checks):
    assert out[0].finish_reason == "stop", (prompt, out[0].text)
    check(out[0].text)


@pytest.mark.slow
def test_the_token_limit_ends_a_constrained_request_with_length(llm):
  out = _generate(llm, ["A long JSON list of numbers:"],
                  [SamplingParams(max_tokens=6, temperature=0.0,
                                  structured_outputs=SO(json={"type": "array", "items": {"type": "integer"},
                                                              "minItems": 50}))])[0][0]
  assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("[")


@pytest.mark.slow
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_goes_on(llm):
  bad = [(SO(json={"type": "objekt"}), "does not compile: Invalid type: objekt"),
         (SO(regex="(ab"), "does not compile: "),
         (SO(grammar="root ::= undefined_rule"), "does not compile: "),
         (SO(json={"type": "integer", "minimum": 5, "maximum": 3}), "does not compile: Unsatisfiable schema"),
         (SO(regex=r"a[^\s\S]"), "admits no output: ")]
  for so, message in bad:
    with pytest.raises(ValueError, match=re.escape(f"StructuredOutputsParams.{so.kind} {message}")):
      llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
  assert not llm.engine.has_unfinished()
  out = _generate(llm, ["Pick:"], [SamplingParams(max_tokens=8, temperature=0.0,
                                                  structured_outputs=SO(choice=["alpha", "beta"]))])[0][0]
  assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


@pytest.mark.slow
def test_a_stream_holds_its_constraint(llm):
  """The streamed pieces join to the constrained text (the draw waits for the previous token)."""
  params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=SO(json=PERSON))
  prompt = "Describe a person named Bo, aged 7, as JSON:"
  with llm.stream(prompt, params) as pieces:
    streamed = "".join(pieces)
  assert streamed == _generate(llm, [prompt], [params])[0][0].text
  jsonschema.validate(json.loads(streamed), PERSON)


def test_a_tokenizer_without_a_vocabulary_is_a_clear_error():
  cfg = tiny_config()
  eng = Engine(tiny_model(cfg), ToyTokenizer(cfg.vocab_size), max_batch=1, max_len=32)
  with pytest.raises(ValueError, match="structured outputs need a `tokenizers` vocabulary"):
    eng.add_request([1, 2, 3], SamplingParams(structured_outputs=SO(regex="a")))
  assert not eng.has_unfinished()


def test_words_cover_the_vocabulary():
  assert structured.words(262144) == 8192 and structured.words(1000) == 32
