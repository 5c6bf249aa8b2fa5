"""Write tiny random Hugging Face models and their transformers outputs as jaxgen's HF test fixtures.

Runs in the reference environment (torch CPU, transformers; `pip install -e .[reference]`) and never
imports jaxgen. For each family (Llama 3.x with "llama3" RoPE scaling, Qwen2 with q/k/v biases, Qwen3
with q/k norms and a head_dim of its own, Mistral with a sliding window on every layer, Gemma 3 text
with local and global layers, linear RoPE scaling and a query scale other than head_dim, Gemma 2 with
soft-capping) it builds a model of a few hundred KB from a transformers config, draws every parameter at
random (biases and norms included, so none is trivially zero or one), and saves it with safetensors
(Llama as several shards with an index, Qwen2 in bfloat16), together with a small tokenizer trained
here (no download), a chat template in the family's turn format and a generation config. It then
reloads the saved directory in float32 and records:

  tests/data/hf/<family>/            the model directory (config.json, *.safetensors, tokenizer files)
  tests/data/hf/<family>.npz         ids_<i>, logits_<i> [T, V] float32 for each prompt
  tests/data/hf/<family>.json        prompts, their ids, the chat conversations and transformers'
                                     `apply_chat_template` renderings (and ids) of them
  tests/data/gguf/<family>.<type>.gguf   the same model as llama.cpp's converter writes it (tensor
                                     names, q/k row order, Gemma's 1 + w norms, rope_freqs, the
                                     tokenizer as metadata), in F32 and for some families Q8_0
  tests/data/gguf/<family>.q8_0.npz  transformers' logits reading the Q8_0 file back

Each F32 GGUF is read back by transformers and must reproduce the safetensors logits (asserted here).

Regenerate with:
  HF_HUB_OFFLINE=1 <reference venv>/bin/python tools/make_hf_fixtures.py --out tests/data/hf
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import (  # noqa: E402
  AddedToken,
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
  trainers,
)
from transformers import (  # noqa: E402
  AutoModelForCausalLM,
  AutoTokenizer,
  GenerationConfig,
  PreTrainedTokenizerFast,
)

SPACE = "\u2581"

CORPUS = [
    "The river bends twice before it reaches the old mill, and in spring it floods the lower field.",
    "She counted the jars on the shelf: seven of plum jam, four of pickled beans, and one unlabeled.",
    "A compiler turns source text into tokens, tokens into a tree, and the tree into machine code.",
    "On Tuesday the market opens at eight; on Saturday it opens at six and closes before noon.",
    "Matrices multiply row by column, so the inner dimensions have to agree.",
    "The kettle whistled while the rain kept tapping on the kitchen window.",
    "Please summarise the report in three short sentences for the meeting tomorrow.",
    "What is the capital of the country with the longest coastline in the world?",
    "Numbers such as 42, 3.14 and 2025 appear in tables, dates and prices.",
    "You are a helpful assistant. Answer briefly and say when you are unsure.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
PROMPTS = [
    "The river bends twice before it reaches the mill.",
    "Please summarise the meeting in three sentences, and say when you are unsure about a number like 3.14.",
    "Zebra crossings: ünïcödé, emoji \U0001f642 and tabs\there!",
]
CONVERSATIONS = [
    # system, user, assistant, user (the acceptance conversation)
    [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "  And of Italy?  "}],
    # no system message
    [{"role": "user", "content": "Hello! How are you today?"},
     {"role": "assistant", "content": "I am fine, thank you."},
     {"role": "user", "content": "Count to three."}],
]

# ---------------------------------------------------------------------------------------------
# Chat templates, one per family, written for these fixtures in each family's documented turn
# format. They use different jinja features (namespace, loop variables, filters, whitespace
# control, raise_exception) so that the renderer is exercised, not just string concatenation.
# ---------------------------------------------------------------------------------------------

LLAMA3_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{% set content = message['content'] | trim %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ content }}<|eot_id|>{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CHATML_TEMPLATE = """{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
{{- '<|im_start|>system\\nYou are a small test model.<|im_end|>\\n' -}}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}"""

QWEN3_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- if messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- if ns.system -%}
{{- '<|im_start|>system\\n' ~ ns.system ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages if message.role != 'system' -%}
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ (message.content | trim) ~ '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}"""

MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system = none -%}
{%- set turns = messages -%}
{%- endif -%}
{{- bos_token -}}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- if message['role'] == 'user' -%}
{%- if loop.last and system -%}
{{- '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' -}}
{%- else -%}
{{- '[INST] ' + message['content'] + '[/INST]' -}}
{%- endif -%}
{%- else -%}
{{- ' ' + message['content'] + eos_token -}}
{%- endif -%}
{%- endfor -%}"""

GEMMA_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{% set prefix = messages[0]['content'] | trim + '\n\n' %}
{% set rest = messages[1:] %}
{% else %}
{% set prefix = '' %}
{% set rest = messages %}
{% endif %}
{% for m in rest %}
  {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {% endif %}
<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}
{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

# How Llama 3's and Qwen 2's tokenizer.json files cut text into words before byte-level BPE.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level_tokenizer(vocab_size: int, specials: list[str], bos: str | None, split: str) -> Tokenizer:
  """Byte-level BPE as Llama 3 and Qwen ship it (a word-split regex, then bytes): specials after
  the learned vocabulary."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  if bos is not None:
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def sentencepiece_tokenizer(merges_wanted: int, specials: list[str], bos: str, unk: str,
                            add_prefix: bool) -> Tokenizer:
  """SentencePiece-style BPE with byte fallback (Mistral, Gemma): specials, then <0xNN>, then pieces."""
  normal = [normalizers.Prepend(SPACE)] if add_prefix else []
  trainer_tok = Tokenizer(models.BPE())
  trainer_tok.normalizer = normalizers.Sequence(normal + [normalizers.Replace(" ", SPACE)])
  trainer_tok.pre_tokenizer = pre_tokenizers.Split(SPACE, "merged_with_next")
  chars = sorted({c for text in CORPUS for c in text.replace(" ", SPACE)} | {SPACE})
  trainer = trainers.BpeTrainer(vocab_size=len(chars) + merges_wanted, initial_alphabet=chars,
                                show_progress=False)
  trainer_tok.train_from_iterator(CORPUS, trainer)
  learned = json.loads(trainer_tok.to_str())["model"]
  pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
  pieces += [p for p, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1])]
  vocab = {p: i for i, p in enumerate(pieces)}
  merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
  tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
  tok.normalizer = trainer_tok.normalizer
  tok.pre_tokenizer = pre_tokenizers.Split(SPACE, "merged_with_next")
  steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if add_prefix:
    steps.append(decoders.Strip(" ", 1, 0))
  tok.decoder = decoders.Sequence(steps)
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, vocab[bos])])
  return tok


# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------

def size(tok: Tokenizer) -> int:
  return tok.get_vocab_size(with_added_tokens=True)


def families() -> dict[str, dict]:
  llama_tok = byte_level_tokenizer(
      340, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
      bos="<|begin_of_text|>", split=LLAMA3_SPLIT)
  qwen_tok = byte_level_tokenizer(330, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, split=QWEN2_SPLIT)
  mistral_tok = sentencepiece_tokenizer(60, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", unk="<unk>",
                                        add_prefix=True)
  gemma_tok = sentencepiece_tokenizer(60, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                                      bos="<bos>", unk="<unk>", add_prefix=False)
  small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, rms_norm_eps=1e-6)
  return {
      "llama": dict(
          config=transformers.LlamaConfig(
              **small, vocab_size=size(llama_tok), max_position_embeddings=256, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=64),
              bos_token_id=llama_tok.token_to_id("<|begin_of_text|>"),
              eos_token_id=llama_tok.token_to_id("<|end_of_text|>")),
          tokenizer=llama_tok, specials=dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"),
          template=LLAMA3_TEMPLATE, eos=["<|end_of_text|>", "<|eot_id|>"], shard="120KB"),
      "qwen2": dict(
          config=transformers.Qwen2Config(
              **small, vocab_size=size(qwen_tok) + 13, max_position_embeddings=512, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
              eos_token_id=qwen_tok.token_to_id("<|im_end|>")),
          tokenizer=qwen_tok, specials=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
          template=CHATML_TEMPLATE, eos=["<|im_end|>", "<|endoftext|>"], dtype=torch.bfloat16),
      "qwen3": dict(
          config=transformers.Qwen3Config(
              **{**small, "num_key_value_heads": 1}, head_dim=32, vocab_size=size(qwen_tok) + 3,
              max_position_embeddings=512, tie_word_embeddings=True,
              rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
              eos_token_id=qwen_tok.token_to_id("<|im_end|>")),
          tokenizer=qwen_tok, specials=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
          template=QWEN3_TEMPLATE, eos=["<|im_end|>", "<|endoftext|>"]),
      "mistral": dict(
          config=transformers.MistralConfig(
              **small, head_dim=16, vocab_size=size(mistral_tok), max_position_embeddings=512, sliding_window=8,
              tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
              bos_token_id=1, eos_token_id=2),
          tokenizer=mistral_tok, specials=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
          template=MISTRAL_TEMPLATE, eos=["</s>"]),
      "gemma3": dict(
          # Six layers: five sliding, one global, the pattern every Gemma 3 has (and GGUF implies).
          config=transformers.Gemma3TextConfig(
              **{**small, "num_hidden_layers": 6, "num_key_value_heads": 1}, head_dim=16,
              vocab_size=size(gemma_tok) + 7, max_position_embeddings=512, sliding_window=8,
              query_pre_attn_scalar=24,
              rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1_000_000.0),
                               "sliding_attention": dict(rope_type="default", rope_theta=10_000.0)},
              bos_token_id=2, eos_token_id=1, pad_token_id=0),
          tokenizer=gemma_tok,
          specials=dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"),
          template=GEMMA_TEMPLATE, eos=["<eos>", "<end_of_turn>"]),
      "gemma2": dict(
          # Soft-capping set low enough to bite on these small logits; query scale 24 != head_dim 16.
          config=transformers.Gemma2Config(
              **{**small, "num_hidden_layers": 4}, head_dim=16, vocab_size=size(gemma_tok) + 7,
              max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=24,
              attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
              rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
              bos_token_id=2, eos_token_id=1, pad_token_id=0),
          tokenizer=gemma_tok,
          specials=dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"),
          template=GEMMA_TEMPLATE, eos=["<eos>", "<end_of_turn>"]),
  }


def randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
  """Every parameter random: matrices N(0, 0.08^2), biases N(0, 0.1^2), norms around their identity."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      elif "embed_tokens" in name:
        p.copy_((0.1 if gemma else 0.5) * noise)
      else:
        p.copy_(0.08 * noise)


def write_family(name: str, spec: dict, out: str, seed: int) -> None:
  model_dir = os.path.join(out, name)
  shutil.rmtree(model_dir, ignore_errors=True)
  torch.manual_seed(seed)
  cfg = spec["config"]
  model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(torch.float32)
  randomize(model, seed, gemma=name.startswith("gemma"))
  model.to(spec.get("dtype", torch.float32)).save_pretrained(model_dir, max_shard_size=spec.get("shard", "50GB"))

  backend: Tokenizer = spec["tokenizer"]
  hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, **spec["specials"])
  hf_tok.chat_template = spec["template"]
  hf_tok.save_pretrained(model_dir)
  GenerationConfig(bos_token_id=cfg.bos_token_id,
                   eos_token_id=[backend.token_to_id(t) for t in spec["eos"]]).save_pretrained(model_dir)

  # Everything below reads the saved directory back, as a user of transformers would.
  tok = AutoTokenizer.from_pretrained(model_dir)
  ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
  arrays, record = {}, {"transformers": transformers.__version__, "torch": torch.__version__, "prompts": []}
  with torch.no_grad():
    for i, prompt in enumerate(PROMPTS):
      ids = tok(prompt)["input_ids"]
      logits = ref(torch.tensor([ids])).logits[0].float().numpy()
      arrays[f"ids_{i}"] = np.asarray(ids, np.int32)
      arrays[f"logits_{i}"] = logits.astype(np.float32)
      record["prompts"].append({"text": prompt, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
  record["chats"] = []
  for conv in CONVERSATIONS:
    for gen_prompt in (True, False):
      text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
      ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen_prompt, return_dict=True)["input_ids"]
      record["chats"].append({"messages": conv, "add_generation_prompt": gen_prompt, "text": text, "ids": list(ids)})
  np.savez_compressed(os.path.join(out, f"{name}.npz"), **arrays)
  with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, ensure_ascii=False)
  size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))
  print(f"{name}: {size / 1e3:.0f} KB in {sorted(os.listdir(model_dir))}")

  gguf_dir = os.path.join(os.path.dirname(os.path.abspath(out)), "gguf")
  os.makedirs(gguf_dir, exist_ok=True)
  for qtype in GGUF_TYPES[name]:
    write_gguf(name, spec, ref, backend, os.path.join(gguf_dir, f"{name}.{qtype.name.lower()}.gguf"), qtype)
  gguf_reference(name, cfg, model_dir, gguf_dir, arrays)


# ---------------------------------------------------------------------------------------------
# The same models as GGUF files, laid out as llama.cpp's convert_hf_to_gguf.py lays them out
# ---------------------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
GGUF_TYPES = {"llama": (Q.F32, Q.Q8_0), "qwen2": (Q.F32,), "qwen3": (Q.F32, Q.Q8_0), "mistral": (Q.F32,),
              "gemma3": (Q.F32,), "gemma2": (Q.F32, Q.Q8_0)}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3": "gemma3",
             "gemma2": "gemma2"}
GGUF_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}

# transformers name (after "model.layers.{i}.") -> llama.cpp name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row order for Llama and Mistral: per head, rotate-half pairs interleaved."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg) -> np.ndarray:
  """The `rope_freqs.weight` tensor llama.cpp writes for "llama3" RoPE scaling: a divisor per frequency."""
  rp = cfg.rope_parameters
  dim = cfg.head_dim
  factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
  old = rp["original_max_position_embeddings"]
  out = []
  for i in range(0, dim, 2):
    wavelen = 2 * np.pi / (rp["rope_theta"] ** (-i / dim))
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def gguf_tensors(name: str, model: torch.nn.Module) -> dict[str, np.ndarray]:
  cfg = model.config
  gemma = name.startswith("gemma")
  out = {}
  for hf_name, p in model.state_dict().items():
    w = p.detach().float().numpy()
    if hf_name == "model.embed_tokens.weight":
      gg = "token_embd.weight"
    elif hf_name == "model.norm.weight":
      gg = "output_norm.weight"
    elif hf_name == "lm_head.weight":
      if cfg.tie_word_embeddings:
        continue
      gg = "output.weight"
    else:
      i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
      if rest == "post_attention_layernorm.weight":
        leaf = "post_attention_norm.weight" if gemma else "ffn_norm.weight"
      else:
        leaf = LAYER_NAMES[rest]
      gg = f"blk.{i}.{leaf}"
    if gemma and gg.endswith("norm.weight"):
      w = w + 1.0  # llama.cpp stores Gemma's norms as 1 + w
    if name in ("llama", "mistral") and gg.endswith(("attn_q.weight", "attn_k.weight")):
      heads = cfg.num_attention_heads if gg.endswith("attn_q.weight") else cfg.num_key_value_heads
      w = llama_cpp_permute(w, heads)
    out[gg] = w
  if name == "llama":
    out["rope_freqs.weight"] = llama3_rope_freqs(cfg)
  return out


def write_gguf(name: str, spec: dict, model: torch.nn.Module, tok: Tokenizer, path: str, qtype) -> None:
  cfg = model.config
  arch = GGUF_ARCH[name]
  w = gguf.GGUFWriter(path, arch)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  rope = cfg.rope_parameters
  w.add_rope_freq_base((rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"])
  w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == Q.F32 else gguf.LlamaFileType.MOSTLY_Q8_0)
  if name in ("llama", "mistral"):
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
  if getattr(cfg, "sliding_window", None):
    w.add_sliding_window(cfg.sliding_window)
  if name.startswith("gemma"):
    w.add_attention_scale(float(cfg.query_pre_attn_scalar) ** -0.5)
  if name == "gemma2":
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
  if name == "gemma3":
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(rope["full_attention"]["factor"])

  # The tokenizer, padded to the model's vocabulary as llama.cpp pads it.
  n = tok.get_vocab_size(with_added_tokens=True)
  tokens = [tok.id_to_token(i) for i in range(n)]
  specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
  types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
  byte_level = name in GGUF_PRE
  if not byte_level:
    unk = spec["specials"].get("unk_token")
    types = [gguf.TokenType.UNKNOWN if t == unk else gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t)
             else k for t, k in zip(tokens, types)]
  for i in range(n, cfg.vocab_size):
    tokens.append(f"[PAD{i}]")
    types.append(gguf.TokenType.UNUSED)
  w.add_tokenizer_model("gpt2" if byte_level else "llama")
  if byte_level:
    w.add_tokenizer_pre(GGUF_PRE[name])
  w.add_token_list(tokens)
  w.add_token_types(types)
  if byte_level:
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if not isinstance(m, str) else m for m in merges])
  else:
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_add_space_prefix(name == "mistral")
  ids = {k: tok.token_to_id(v) for k, v in spec["specials"].items()}
  if "bos_token" in ids:
    w.add_bos_token_id(ids["bos_token"])
  w.add_eos_token_id(ids["eos_token"])
  if "pad_token" in ids:
    w.add_pad_token_id(ids["pad_token"])
  if "unk_token" in ids:
    w.add_unk_token_id(ids["unk_token"])
  w.add_add_bos_token("bos_token" in ids)
  w.add_chat_template(spec["template"])

  for gg, arr in gguf_tensors(name, model).items():
    if qtype == Q.Q8_0 and arr.ndim == 2:
      w.add_tensor(gg, gguf.quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
    else:
      w.add_tensor(gg, arr.astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  print(f"  {os.path.basename(path)}: {os.path.getsize(path) / 1e3:.0f} KB")


def gguf_reference(name: str, cfg, model_dir: str, gguf_dir: str, hf_arrays: dict) -> None:
  """transformers reading each GGUF back (its own tensor and tokenizer conversion, with the true
  config: transformers' GGUF config reader does not know every knob set here). For F32 files this
  must give the safetensors logits again (checked here); for quantized files the logits are kept as
  the reference for jaxgen reading the same file."""
  if name == "mistral":
    # gguf-py knows no "mistral" architecture (llama.cpp writes Mistral 7B as "llama", without its
    # sliding window), so transformers cannot read this file; jaxgen reading it is checked against
    # the safetensors logits, which are the same weights in float32.
    return
  tok_ids = {}
  for qtype in GGUF_TYPES[name]:
    fname = f"{name}.{qtype.name.lower()}.gguf"
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=fname, config=cfg, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    arrays = {}
    with torch.no_grad():
      for i in range(len(PROMPTS)):
        ids = hf_arrays[f"ids_{i}"]
        arrays[f"ids_{i}"] = ids
        arrays[f"logits_{i}"] = ref(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    if qtype == Q.F32:
      err = max(np.abs(arrays[f"logits_{i}"] - hf_arrays[f"logits_{i}"]).max() for i in range(len(PROMPTS)))
      assert err < 1e-5, f"{fname}: transformers reads its F32 GGUF back {err} away from the safetensors"
    else:
      np.savez_compressed(os.path.join(gguf_dir, fname.replace(".gguf", ".npz")), **arrays)
    if not tok_ids:
      tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=fname)
      tok_ids = {p: tok(p)["input_ids"] for p in PROMPTS}
      for i, p in enumerate(PROMPTS):
        if list(tok_ids[p]) != hf_arrays[f"ids_{i}"].tolist():
          print(f"  note: transformers' GGUF tokenizer for {name} gives {tok_ids[p]} for prompt {i}, "
                f"the model's own tokenizer {hf_arrays[f'ids_{i}'].tolist()}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.path.join("tests", "data", "hf"))
  ap.add_argument("--only", nargs="*", default=None, help="families to write (default: all)")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  for seed, (name, spec) in enumerate(families().items()):
    if a.only is None or name in a.only:
      write_family(name, spec, a.out, seed)


if __name__ == "__main__":
  main()
