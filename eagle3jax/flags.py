"""The scripts' integer-list flags (``--mesh 1,8``, ``--capture 1,5,8``, ``--batches 1,4``):
one parser, so every script refuses a malformed list the same way, naming its flag, instead of
a traceback from ``int()``; ``positive_int`` for counts (``--runs``, ``--repeats``);
``check_writable`` for output files and ``require_modules`` for the optional packages a script
needs, both checked before a long run rather than after it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile


def _int_at_least(text: str, low: int) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < low:
    raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
  return value


def positive_int(text: str) -> int:
  """An argparse ``type`` for counts and sizes: an integer >= 1 (argparse then names the flag
  and exits 2)."""
  return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
  """An argparse ``type`` for seeds and offsets: an integer >= 0."""
  return _int_at_least(text, 0)


def measured_new_tokens(text: str) -> int:
  """An argparse ``type`` for the ``--max-new-tokens`` of a measurement: an integer >= 2 (with
  1 the prefill emits the only token, so no round runs and there is nothing to measure)."""
  return _int_at_least(text, 2)


def confidence_level(text: str) -> float:
  """An argparse ``type`` for a confidence level: a number strictly between 0 and 1."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not 0 < value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be between 0 and 1 (e.g. 0.95)")
  return value


def require_modules(needs: dict[str, str], install: str) -> None:
  """Raises ``ValueError`` naming each missing optional module (``needs``: module -> what needs
  it) and the command that installs them."""
  missing = [f"{m} ({why})" for m, why in needs.items() if importlib.util.find_spec(m) is None]
  if missing:
    raise ValueError(f"missing {', '.join(missing)}: install with {install}")


def parse_ints(text: str, flag: str, *, count: int | None = None,
               form: str = "comma-separated integers", unique: bool = False
               ) -> tuple[int, ...]:
  """``"1, 5,8"`` -> ``(1, 5, 8)``; blanks around items and a trailing comma are ignored.

  Args:
    text: the flag's value.
    flag: the flag's name as the user typed it (``"--mesh"``), for the error.
    count: if given, exactly this many integers are required.
    form: what the flag expects, in words, for the error (e.g. ``"DATA,TENSOR"``).
    unique: refuse a value given twice (a list of settings to measure: a repeat would be
      measured twice and pooled into one row's statistics).

  Raises:
    ValueError: ``"{flag} {text!r}: expected {form}"`` when an item is not an integer, the
      list is empty, or it does not have ``count`` items; with ``unique``, a repeated value.
  """
  items = [x.strip() for x in str(text).split(",")]
  if items and not items[-1]:
    items.pop()  # "1,2," is "1,2"
  try:
    values = tuple(int(x) for x in items)
  except ValueError:
    values = ()
  if not values or (count is not None and len(values) != count):
    raise ValueError(f"{flag} {text!r}: expected {form}")
  if unique and len(set(values)) != len(values):
    twice = sorted({v for v in values if values.count(v) > 1})
    raise ValueError(f"{flag} {text!r} names {twice} more than once; give each value once")
  return values


def check_writable(path: str, flag: str) -> None:
  """Raises ``ValueError`` naming ``flag`` when ``path`` cannot be written: its folder is
  missing or refuses a new file (tried, since permission bits do not bind root and do not show
  a read-only mount), or it is a folder itself. Checked before a run, not after it."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a folder; give a file name")
  if not os.path.isdir(folder):
    raise ValueError(f"{flag} {path!r}: folder {folder!r} does not exist; create it first")
  try:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".eagle3jax-write-check-"):
      pass
  except OSError as e:
    raise ValueError(f"{flag} {path!r}: folder {folder!r} is not writable ({e.strerror})"
                     ) from None
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise ValueError(f"{flag} {path!r} exists and is not writable")


def write_output(path: str, flag: str, write) -> None:
  """Runs ``write(file)`` on ``path`` opened for writing; an ``OSError`` (the disk filled, the
  folder went away during the run) becomes a ``ValueError`` naming ``flag``."""
  try:
    with open(path, "w", encoding="utf-8") as f:
      write(f)
  except OSError as e:
    raise ValueError(f"{flag} {path!r} could not be written: {e.strerror or e}") from None


def write_json(path: str, flag: str, value, script: str) -> int:
  """A script's last step: ``value`` as JSON to ``path`` (the ``flag`` output); returns the
  exit status, 0, or 2 after ``script``'s one error line when the file cannot be written."""
  try:
    write_output(path, flag, lambda f: json.dump(value, f, indent=1))
  except ValueError as e:
    print(f"{script}: error: {e}", file=sys.stderr)
    return 2
  return 0


def need_file(path: str, flag: str) -> None:
  """Raises ``ValueError`` naming ``flag`` unless ``path`` is an existing file."""
  if not os.path.isfile(path):
    raise ValueError(f"{flag} {path!r} " + ("is a folder; give a file" if os.path.isdir(path)
                                            else "does not exist"))


def read_json(path: str, flag: str, *, want_object: bool = False):
  """The JSON value in the file ``flag`` names, or a ``ValueError`` naming the flag and file
  (missing, a folder, not JSON, or, with ``want_object``, not a JSON object)."""
  need_file(path, flag)
  with open(path) as f:
    try:
      value = json.load(f)
    except ValueError as e:
      raise ValueError(f"{flag} {path!r} is not JSON: {e}") from None
  if want_object and not isinstance(value, dict):
    raise ValueError(f"{flag} {path!r} must hold a JSON object, not a {type(value).__name__}")
  return value
