"""Which argument is which model: a target (``DecoderLM``: Llama family, DeepSeek family) or an
EAGLE-3 drafter (``Eagle3Drafter``).

Every public entry point that takes a model checks its kind here first, so a drafter passed
where the target goes (or the reverse, or anything else) is said as such, naming the argument,
not met later as an ``AttributeError`` from inside.
"""

from __future__ import annotations

from eagle3jax.decoder import DecoderLM
from eagle3jax.drafter import Eagle3Drafter


def _what(obj) -> str:
  if isinstance(obj, Eagle3Drafter):
    return "an EAGLE-3 drafter"
  if isinstance(obj, DecoderLM):
    return "a target model"
  return f"a {type(obj).__name__}"


def require_target(name: str, obj) -> None:
  """Raises ``ValueError`` unless ``obj`` (the argument ``name``) is a target model."""
  if not isinstance(obj, DecoderLM):
    raise ValueError(f"{name} must be a target model (load_target / init_target); got "
                     f"{_what(obj)}")


def require_drafter(name: str, obj, alternative: str = "") -> None:
  """Raises ``ValueError`` unless ``obj`` (the argument ``name``) is an EAGLE-3 drafter;
  ``alternative`` names what else the argument may be (" or None for ...")."""
  if not isinstance(obj, Eagle3Drafter):
    raise ValueError(f"{name} must be an EAGLE-3 drafter (load_drafter / init_drafter)"
                     f"{alternative}; got {_what(obj)}")


# Which init function builds a model of each config family.
_INIT_OF = {"LlamaConfig": "init_target", "DeepseekConfig": "eagle3jax.init_deepseek"}


def require_config(fn: str, cfg, expected: type, hint: str = "") -> None:
  """Raises ``ValueError`` unless ``cfg`` (the config given to ``fn``) is an ``expected``;
  says ``hint`` if given, else names the init function of the config family it is."""
  if not isinstance(cfg, expected):
    other = _INIT_OF.get(type(cfg).__name__)
    advice = hint or (f"use {other} for that config" if other else "")
    raise ValueError(f"{fn} takes a {expected.__name__}, got {type(cfg).__name__}"
                     + (f": {advice}" if advice else ""))
