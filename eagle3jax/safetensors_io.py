"""Reading Hugging Face safetensors checkpoints without copying them.

A small reader of the safetensors format (8-byte little-endian header size, JSON header, raw
data) over ``numpy.memmap``, so any tensor, bf16 and float8 included (via ``ml_dtypes``), is a
zero-copy view and a sharded loader reads only the slices each device needs.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
  """One ``.safetensors`` file: ``names``, ``shape(name)``, ``get(name)`` (a memmap view)."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
      if raw.startswith(b"version "):
        raise ValueError(f"{path} is a git-lfs pointer, not the weights: fetch them with "
                         "`git lfs pull` (or download the file itself)")
      (n,) = struct.unpack("<Q", raw)
      size = os.path.getsize(path)
      if n > size - 8:
        raise ValueError(f"{path} is not a safetensors file: its first 8 bytes give a "
                         f"{n}-byte header, but the file has {size} bytes (an HTML page or a "
                         "partial download? download it again)")
      try:
        header = json.loads(f.read(n))
      except ValueError as e:
        raise ValueError(f"{path} is not a safetensors file (bad header: {e})") from None
    if not isinstance(header, dict):
      raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    self._header = header
    self._base = 8 + n
    self._mm = None
    self._check_extents(os.path.getsize(path) - self._base)

  def _check_extents(self, data_bytes: int) -> None:
    """Every tensor's byte range lies in the file and fits its shape and dtype (a truncated
    or corrupt file is named here with the tensor, not found later as a reshape error)."""
    for name, info in self._header.items():
      try:
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        dtype = info["dtype"]
      except (KeyError, TypeError, ValueError):
        raise ValueError(f"{self.path}: tensor {name!r} has a malformed header entry "
                         f"{info!r}") from None
      if end > data_bytes or start > end:
        raise ValueError(f"{self.path}: tensor {name!r} needs bytes {start}..{end} of the "
                         f"data section, but the file holds only {data_bytes} (truncated or "
                         "corrupt file; download it again)")
      if dtype in _DTYPES and end - start != int(np.prod(shape)) * np.dtype(
          _DTYPES[dtype]).itemsize:
        raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} and dtype {dtype} "
                         f"should take {int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize}"
                         f" bytes but its header gives {end - start} (corrupt file)")

  @property
  def names(self) -> list[str]:
    return list(self._header)

  def __contains__(self, name: str) -> bool:
    return name in self._header

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    info = self._header[name]
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    start, end = info["data_offsets"]
    dtype = np.dtype(_DTYPES[info["dtype"]])
    buf = self._mm[self._base + start:self._base + end]
    return buf.view(dtype).reshape(info["shape"])


class SafetensorsDir:
  """All tensors of a checkpoint directory: ``model.safetensors`` or a sharded index."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    self._files: dict[str, SafetensorsFile] = {}
    self._where: dict[str, str] = {}
    if os.path.exists(index):
      with open(index) as f:
        try:
          data = json.load(f)
        except ValueError as e:
          raise ValueError(f"{index} is not valid JSON ({e})") from None
      weight_map = data.get("weight_map") if isinstance(data, dict) else None
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' object")
      for name, fname in weight_map.items():
        fpath = os.path.join(path, fname)
        if fpath not in self._files:
          if not os.path.exists(fpath):
            raise ValueError(f"{index} names {fname} for weight {name!r}, but the file is "
                             "missing")
          self._files[fpath] = SafetensorsFile(fpath)
        if name not in self._files[fpath]:
          raise ValueError(f"{index} maps weight {name!r} to {fname}, but that file does not "
                           "hold it (a stale or mismatched index; download the checkpoint "
                           "again)")
        self._where[name] = fpath
    elif os.path.exists(single):
      self._files[single] = SafetensorsFile(single)
      self._where = {n: single for n in self._files[single].names}
    else:
      raise ValueError(f"{path} has neither model.safetensors nor "
                       "model.safetensors.index.json")

  @property
  def names(self) -> list[str]:
    return list(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    return self._files[self._where[name]].shape(name)

  def get(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get(name)


def check_finite(array: np.ndarray, name: str, where: str) -> None:
  """Raises ValueError naming ``name`` when a float weight holds NaN or Inf."""
  a = np.asarray(array)
  if a.dtype.kind != "f" and "float" not in str(a.dtype):
    return  # integer / bool / packed quantised data
  total = np.sum(a, dtype=np.float32)
  if np.isfinite(total):
    return
  bad = a.astype(np.float32)
  nan, inf = int(np.isnan(bad).sum()), int(np.isinf(bad).sum())
  if nan or inf:
    raise ValueError(f"{where}: weight {name!r} holds {nan} NaN and {inf} Inf values; the "
                     "checkpoint is corrupt (or was saved after a diverged training step)")
