#!/usr/bin/env python3
"""Decode a prompt with EAGLE-3 speculative decoding. ``--help`` lists the flags."""

import sys

from eagle3jax.decode_cli import run

if __name__ == "__main__":
  sys.exit(run())
