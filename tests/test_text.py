"""The scripts' tokenisation: chat templates where transformers writes them, and clear errors."""

import json
import os

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from eagle3jax.text import TextCodec

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", ":", "assistant", "A", "B"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
MESSAGES = [{"role": "user", "content": "hello world"}]


def _saved(tmp_path, template=TEMPLATE):
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                            eos_token="</s>", unk_token="<unk>")
  hf.chat_template = template
  hf.save_pretrained(str(tmp_path))
  return hf


def _hf_ids(hf, template=None):
  out = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                               chat_template=template)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_as_transformers_saves_and_renders_it(tmp_path):
  # transformers writes the template to chat_template.jinja (not tokenizer_config.json): it
  # used to be ignored, so an instruct target got the raw text.
  hf = _saved(tmp_path)
  assert os.path.exists(tmp_path / "chat_template.jinja")
  assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert TextCodec(str(tmp_path)).encode_prompt("hello world") == _hf_ids(hf) == [
      1, 5, 6, 3, 4, 7, 6]


def test_chat_template_loop_controls_and_named_list(tmp_path):
  # Loop controls (transformers enables them) and the list form with a 'default' template.
  template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{{ m['content'] }} {% endfor %}assistant :")
  hf = _saved(tmp_path, template)
  os.remove(tmp_path / "chat_template.jinja")
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  cfg["chat_template"] = [{"name": "tool_use", "template": "B"},
                          {"name": "default", "template": template}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  assert TextCodec(str(tmp_path)).encode_prompt("hello world") == _hf_ids(hf, template)
  cfg["chat_template"] = [{"name": "tool_use", "template": "B"}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"named templates \['tool_use'\] without a 'default'"):
    TextCodec(str(tmp_path))


@pytest.mark.parametrize("template, message", [
    ("{% if true %}A", "does not parse as Jinja"),
    ("{{ raise_exception('only user turns') }}", "refused the prompt: only user turns"),
])
def test_chat_template_errors_are_named(tmp_path, template, message):
  _saved(tmp_path, template)
  with pytest.raises(ValueError, match=message):
    TextCodec(str(tmp_path)).encode_prompt("hello")


@pytest.mark.parametrize("template", [
    "{% for m in messages %}user : {{ m['content'] + ' ' + eos_token }}{% endfor %}A",
    "{% for m in messages %}{{ m['content'] }} {{ eos_token }}{% endfor %} {{ unk_token }} A",
])
def test_chat_template_gets_the_special_tokens(tmp_path, template):
  """Only bos_token was passed: a Zephyr-style `+ eos_token` raised jinja2's UndefinedError,
  and `{{ eos_token }}` rendered empty, a prompt other than transformers'."""
  hf = _saved(tmp_path, template)
  assert TextCodec(str(tmp_path)).encode_prompt("hello world") == _hf_ids(hf)


def test_chat_template_render_errors_are_named_and_sandboxed(tmp_path):
  _saved(tmp_path, "{{ messages[1]['content'] }}")  # one message: an undefined index
  with pytest.raises(ValueError, match=r"the chat template failed on this prompt \(Undefined"):
    TextCodec(str(tmp_path)).encode_prompt("hello")
  # A template is downloaded code: rendered in jinja2's sandbox, as transformers does.
  _saved(tmp_path, "{{ messages.__class__.__mro__ }}")
  with pytest.raises(ValueError, match=r"failed on this prompt \(SecurityError"):
    TextCodec(str(tmp_path)).encode_prompt("hello")


def test_unreadable_tokenizer_files_are_named(tmp_path):
  _saved(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text("[]")
  with pytest.raises(ValueError, match="tokenizer_config.json must hold a JSON object"):
    TextCodec(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(ValueError, match=r"tokenizer.json could not be read as a tokenizer"):
    TextCodec(str(tmp_path))
  os.remove(tmp_path / "tokenizer.json")
  with pytest.raises(ValueError, match=r"has no tokenizer.json .* pass token ids"):
    TextCodec(str(tmp_path))


def test_a_prompt_that_is_not_utf8_is_named():
  # Undecodable bytes of a command line arrive as lone surrogates; tokenizers raised a bare
  # TypeError on them, which decode.py did not catch.
  codec = TextCodec("models/default/target")
  with pytest.raises(ValueError, match=r"not valid UTF-8 text \(character 3: '\\udcff'\)"):
    codec.encode_prompt("abc\udcff")
