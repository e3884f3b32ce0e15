"""Tokenisation for the scripts: ``tokenizer.json`` via the ``tokenizers`` package, and the
chat template when the directory has one (``chat_template.jinja``, where recent
``transformers`` versions save it, or ``tokenizer_config.json``'s ``chat_template``: a string,
or a list of named templates of which ``default`` is used)."""

from __future__ import annotations

import json
import os


# The special tokens transformers passes to a chat template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class TextCodec:
  """Encodes prompts and decodes ids with a checkpoint directory's tokenizer."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_path):
      raise ValueError(f"{path!r} has no tokenizer.json to encode text with; pass token ids "
                       "instead of text")
    try:
      self.tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # the tokenizers package raises a bare Exception
      raise ValueError(f"{tok_path} could not be read as a tokenizer ({e}); pass token ids "
                       "instead of text, or fix the file") from None
    self.chat_template = None
    self.special_tokens = {}
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      try:
        with open(cfg_path, encoding="utf-8") as f:
          cfg = json.load(f)
      except ValueError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e})") from None
      if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object")
      self.chat_template = _named_template(cfg.get("chat_template"), cfg_path)
      for name in SPECIAL_TOKENS:  # a string, or an AddedToken's {"content": ...}
        value = cfg.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
          self.special_tokens[name] = value
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_path):  # where transformers saves it now; it wins, as there
      with open(jinja_path, encoding="utf-8") as f:
        self.chat_template = f.read()

  def encode_prompt(self, text: str) -> list[int]:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable bytes kept as lone surrogates (\udcff)
      raise ValueError(f"the prompt is not valid UTF-8 text (character {e.start}: "
                       f"{text[e.start]!r}); pass UTF-8 text, or token ids") from None
    if self.chat_template:
      import jinja2  # pylint: disable=import-outside-toplevel
      import jinja2.sandbox  # pylint: disable=import-outside-toplevel
      # As transformers renders chat templates: sandboxed (a template is downloaded code), loop
      # controls, raise_exception, and the tokenizer's special tokens as variables.
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(
          trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
      env.globals["raise_exception"] = _raise_exception
      try:
        template = env.from_string(self.chat_template)
      except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not parse as Jinja ({e}); fix it, or pass "
                         "--prompt-ids") from None
      try:
        text = template.render(messages=[{"role": "user", "content": text}],
                               add_generation_prompt=True,
                               **{"bos_token": "", **self.special_tokens})
      except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed on this prompt ({type(e).__name__}: {e}); "
                         "fix the template or tokenizer_config.json, or pass --prompt-ids"
                         ) from None
      return self.tokenizer.encode(text, add_special_tokens=False).ids
    return self.tokenizer.encode(text).ids

  def decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)


def _raise_exception(message):
  raise ValueError(f"the chat template refused the prompt: {message}")


def _named_template(value, where: str):
  """A chat template given as a string, or as ``[{"name": ..., "template": ...}]`` (the
  ``default`` one is used); None when there is none."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, dict) for t in value):
    named = {t.get("name"): t.get("template") for t in value}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(f"{where}: chat_template is a list of named templates "
                     f"{sorted(map(str, named))} without a 'default' one")
  raise ValueError(f"{where}: chat_template must be a string or a list of named templates; "
                   f"got {type(value).__name__}")
