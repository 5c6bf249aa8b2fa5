"""The chat-template renderer: transformers' jinja environment, the Gemma fallback, the stop ids.

Renderings of the fixtures' own templates against transformers are in test_hf.py; here are the
parts that need no model: sandboxing, extensions, error messages and the built-in Gemma format.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from jaxgen.checkpoints.chat import (
  GEMMA_TURNS,
  TemplateError,
  chat_format,
  conversations,
  render,
)
from jaxgen.checkpoints.hf_tokenizer import chat_template_of
from jaxgen.checkpoints.tokenizer import Tokenizer
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as Backend

HF = pathlib.Path(__file__).parent / "data" / "hf"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def word_tokenizer(words: list[str], specials: list[str], **kw) -> Tokenizer:
  vocab = {w: i for i, w in enumerate(specials + words)}
  backend = Backend(models.WordLevel(vocab, unk_token=specials[0]))
  backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  return Tokenizer(backend, **kw)


def test_gemma_turns_format():
  text = render(GEMMA_TURNS, CONVERSATION, special_tokens={"bos_token": "<bos>"})
  assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                  "<start_of_turn>model\nHello!<end_of_turn>\n"
                  "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
                  "<start_of_turn>model\n")
  assert render(GEMMA_TURNS, CONVERSATION[1:2], add_generation_prompt=False, special_tokens={"bos_token": "<bos>"}) \
      == "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
  with pytest.raises(TemplateError, match="got tool"):
    render(GEMMA_TURNS, [{"role": "tool", "content": "x"}], special_tokens={"bos_token": "<bos>"})


def test_gemma_vocabulary_without_template_falls_back_and_says_so():
  tok = word_tokenizer(["hi"], ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], bos_id=2, eos_id=1)
  fmt = chat_format(tok)
  assert fmt.fallback and "Gemma" in fmt.note
  assert fmt.stop_ids == {1, 4}
  assert fmt.render(CONVERSATION[1:2]).startswith("<bos><start_of_turn>user\n")


def test_no_template_and_not_gemma_is_an_error():
  tok = word_tokenizer(["hi"], ["<unk>", "<s>", "</s>"], bos_id=1, eos_id=2)
  with pytest.raises(ValueError, match="no chat template"):
    chat_format(tok)
  fmt = chat_format(tok, template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
  assert fmt.render(CONVERSATION[1:2]) == "<s>Hi there " and not fmt.fallback and fmt.note is None


def test_stop_ids_are_the_end_of_turn_tokens_the_template_writes():
  tok = word_tokenizer(["hi"], ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"], eos_id=1)
  fmt = chat_format(tok, template="{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
  assert fmt.stop_ids == {1, 3}  # EOS and <|im_end|>; <|eot_id|> is in the vocabulary but not the template


def test_template_raise_exception_is_reported():
  template = (HF / "mistral" / "chat_template.jinja").read_text()
  with pytest.raises(TemplateError, match="roles must alternate"):
    render(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
           special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_environment_matches_transformers():
  msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "x"}]
  # tojson keeps non-ASCII and does not HTML-escape
  assert render("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "héllo <b>"}'
  assert render("{{ messages[1] | tojson(indent=1) }}", msgs) == '{\n "role": "assistant",\n "content": "x"\n}'
  # loop controls, the generation block, trim_blocks / lstrip_blocks
  assert render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
                msgs) == "user"
  assert render("{% generation %}{{ messages[1].content }}{% endgeneration %}", msgs) == "x"
  assert render("{% if true %}\n  a\n  {% endif %}\nb", msgs) == "  a\nb"
  assert render("{{ bos_token }}|{{ add_generation_prompt }}", msgs, add_generation_prompt=False,
                special_tokens={"bos_token": "<s>"}) == "<s>|False"
  assert len(render("{{ strftime_now('%Y') }}", msgs)) == 4


def test_sandbox_blocks_python_internals():
  with pytest.raises(TemplateError):
    render("{{ messages.__class__.__mro__ }}", CONVERSATION)
  with pytest.raises(TemplateError):
    render("{{ messages.append(1) }}", CONVERSATION)  # immutable sandbox


def test_template_syntax_error_is_a_clear_error():
  with pytest.raises(TemplateError, match="does not parse"):
    render("{% for m in messages %}", CONVERSATION)


def test_named_templates_in_tokenizer_config(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
  assert chat_template_of(str(tmp_path)) == "D"
  (tmp_path / "chat_template.jinja").write_text("J")
  assert chat_template_of(str(tmp_path)) == "J"


def test_conversations_accepts_one_or_many():
  assert conversations(CONVERSATION) == [CONVERSATION]
  assert conversations([CONVERSATION, CONVERSATION[:2]]) == [CONVERSATION, CONVERSATION[:2]]
  with pytest.raises(ValueError, match="messages is empty"):
    conversations([])
  with pytest.raises(ValueError, match="conversation 1"):
    conversations([CONVERSATION, []])
