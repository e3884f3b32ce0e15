#!/usr/bin/env python3
"""Decode a prompt with EAGLE-3 speculative decoding. ``--help`` lists the flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3jax.decode_cli import run  # noqa: E402

if __name__ == "__main__":
  sys.exit(run())
