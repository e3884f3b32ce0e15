"""Tokenisation for the scripts: ``tokenizer.json`` via the ``tokenizers`` package, and the
chat template of ``tokenizer_config.json`` when the directory has one."""

from __future__ import annotations

import json
import os


class TextCodec:
  """Encodes prompts and decodes ids with a checkpoint directory's tokenizer."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_path):
      raise ValueError(f"{path!r} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    self.tokenizer = Tokenizer.from_file(tok_path)
    self.chat_template = None
    self.bos_token = None
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)
      self.chat_template = cfg.get("chat_template")
      bos = cfg.get("bos_token")
      self.bos_token = bos.get("content") if isinstance(bos, dict) else bos

  def encode_prompt(self, text: str) -> list[int]:
    if self.chat_template:
      import jinja2  # pylint: disable=import-outside-toplevel
      env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
      text = env.from_string(self.chat_template).render(
          messages=[{"role": "user", "content": text}], add_generation_prompt=True,
          bos_token=self.bos_token or "")
      return self.tokenizer.encode(text, add_special_tokens=False).ids
    return self.tokenizer.encode(text).ids

  def decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)
