"""Stacked layers run as scans: segments at the captures, layer slicing, and a compiled program
whose size does not grow with depth."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import eagle3jax
from eagle3jax import bench_compile
from eagle3jax.stack import layer_at, segments, stack_size


def test_segments_split_after_captures_and_at_stack_boundaries():
  # One stack of 12 layers, captures after layers 1, 5 and 8 (and -1, which is no cut).
  assert segments([(0, 12)], [1, 5, 8]) == [(0, 0, 2), (0, 2, 6), (0, 6, 9), (0, 9, 12)]
  # A capture of the last layer adds no empty segment; no captures: one segment.
  assert segments([(0, 12)], [11]) == [(0, 0, 12)]
  assert segments([(0, 12)], []) == [(0, 0, 12)]
  # DeepSeek: 3 dense layers then 58 MoE layers, captures [2, 30, 58].
  assert segments([(0, 3), (3, 61)], [2, 30, 58]) == [
      (0, 0, 3), (1, 3, 31), (1, 31, 59), (1, 59, 61)]


def test_layer_at_is_the_per_layer_slice():
  model = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=3), seed=2)
  assert stack_size(model.layers) == 3
  layer = layer_at(model.layers, 2)
  np.testing.assert_array_equal(np.asarray(layer.mlp.up_proj[...]),
                                np.asarray(model.layers.mlp.up_proj[...][2]))


def test_random_layers_differ_and_are_seeded_per_layer():
  a = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=3), seed=2)
  w = np.asarray(a.layers.self_attn.q_proj[...])
  assert not np.allclose(w[0], w[1])


def _program_sizes(num_layers):
  progs = bench_compile.lowered_programs(num_layers, prompt_len=16, max_len=64)
  return {k: len(v.as_text()) for k, v in progs.items()}


def test_compiled_program_does_not_grow_with_depth():
  """The lowered forward (with captures), prefill and decode loop of an 8-layer and a 40-layer
  target have the same size: one copy of the layer, whatever the depth."""
  small, deep = _program_sizes(8), _program_sizes(40)
  for name in small:
    assert deep[name] < 1.02 * small[name], (name, small[name], deep[name])


def test_compile_benchmark_reports_medians_and_ratios():
  """scripts/bench_compile.py's measurement on two small depths: every program compiles, each
  depth has a median, a range and a ratio to the first depth (1 for the first)."""
  from eagle3jax import bench_compile  # pylint: disable=import-outside-toplevel
  events = []
  listener = lambda event, **kw: events.append(event)  # noqa: E731
  jax.monitoring.register_event_listener(listener)
  try:
    result = bench_compile.compile_scaling((3, 5), repeats=2, log=lambda m: None)
    during = len(events)
    jax.jit(lambda x: x * 3 + 1).lower(jnp.ones(5)).compile()
  finally:
    jax.monitoring.unregister_event_listener(listener)
  # Every repeat ran XLA: the suite's persistent cache (conftest) was neither read nor written
  # during the benchmark, and it is back in use after it.
  assert not [e for e in events[:during] if e.startswith("/jax/compilation_cache/compile_requests")]
  assert os.environ.get("JAX_COMPILATION_CACHE_DIR") and jax.config.jax_enable_compilation_cache
  assert "/jax/compilation_cache/compile_requests_use_cache" in events[during:]
  first, second = result["rows"]
  assert first["forward_ratio"] == first["decode_ratio"] == 1.0
  for row in result["rows"]:
    for k in ("forward", "decode"):
      lo, hi = row[k + "_range_s"]
      assert 0 < lo <= row[k + "_s"] <= hi
  assert second["layers"] == 5 and second["decode_ratio"] > 0
  assert "| 5 |" in bench_compile.markdown(result)


def test_split_layers_decode_and_export_exactly_like_the_scan(tmp_path):
  """``layer_loop="split"`` (one-layer stacks, the CPU serving path) computes what the scan
  does: same logits and captures, same greedy speculative tokens; exported, it is the same
  checkpoint; bad values are refused by name."""
  import pytest
  from eagle3jax import stack
  from eagle3jax.hf_export import save_target
  from tests import engine_helpers as h
  scan = h.target()
  split = eagle3jax.init_target(h.CFG, seed=0, std=0.1, layer_loop="split")
  assert (scan.layer_loop, split.layer_loop) == ("scan", "split")
  assert [off for _, off in split.layer_stacks()] == list(range(h.CFG.num_hidden_layers))
  ids = np.random.default_rng(0).integers(0, h.CFG.vocab_size, (2, 9))
  a = eagle3jax.forward(scan, ids, capture=h.CAPTURE)
  b = eagle3jax.forward(split, ids, capture=h.CAPTURE)
  for x, y in ((a.logits, b.logits), (a.aux_hidden, b.aux_hidden)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  kw = dict(max_new_tokens=16, eos_ids=[], num_steps=3)
  assert (eagle3jax.generate(split, h.copy_drafter(split), h.PROMPTS, **kw).tokens
          == eagle3jax.generate(scan, h.copy_drafter(scan), h.PROMPTS, **kw).tokens)
  save_target(scan, str(tmp_path / "scan"), dtype=np.float32)
  save_target(split, str(tmp_path / "split"), dtype=np.float32)
  back = eagle3jax.load_target(str(tmp_path / "split"), dtype=jnp.float32, layer_loop="split")
  np.testing.assert_array_equal(np.asarray(eagle3jax.forward(back, ids).logits),
                                np.asarray(b.logits))
  from safetensors.numpy import load_file
  x, y = load_file(str(tmp_path / "scan/model.safetensors")), load_file(
      str(tmp_path / "split/model.safetensors"))
  assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
  assert stack.default_layer_loop() == "split"  # CPU
  with pytest.raises(ValueError, match="layer_loop='unrolled'.*'scan', 'split'"):
    eagle3jax.init_target(h.CFG, layer_loop="unrolled")


def test_a_second_load_of_a_model_compiles_nothing(tmp_path):
  """``load_target`` zero-fills its layer stacks through jitted programs kept per shape: a
  second load of the same checkpoint compiles nothing (it compiled every buffer again)."""
  from eagle3jax.hf_export import save_target
  from tests import engine_helpers as h
  save_target(h.target(), str(tmp_path / "t"), dtype=np.float32)
  compiles = []

  def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)
  jax.monitoring.register_event_duration_secs_listener(listen)
  jax.clear_caches()  # so that the first load compiles what it needs
  try:
    first = eagle3jax.load_target(str(tmp_path / "t"), dtype=jnp.float32)
    assert compiles, "the first load compiles its zero-fill programs (else this test is void)"
    compiles.clear()
    second = eagle3jax.load_target(str(tmp_path / "t"), dtype=jnp.float32)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []
  ids = np.arange(9)[None] % h.CFG.vocab_size
  np.testing.assert_array_equal(np.asarray(eagle3jax.forward(first, ids).logits),
                                np.asarray(eagle3jax.forward(second, ids).logits))
