"""Weights as the kernels address them: a 2-D matrix or per-head matrices read in place from
the arena (the placed GGUF bytes), by byte offset and GGML block type. Declared here, below
the architectures and the model, so that an architecture can name a matrix it lays out
(deepseek4's grouped output projection) without importing the model that composes it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QMat:
    """A 2-D weight read in place from the arena: ``n_rows`` output rows of ``n_cols`` inputs,
    GGML block type ``ggml_type``, starting at byte ``offset`` of the arena."""

    name: str
    offset: int
    ggml_type: int
    n_rows: int
    n_cols: int


@dataclass(frozen=True)
class HeadMat:
    """Per-head 2-D weights read in place: head h is ``n_rows`` rows of ``n_cols`` inputs at
    byte ``offset + h * head_stride`` of the arena (a 3-D tensor {n_cols, n_rows, NH}, or
    head-strided row groups of a 2-D one)."""

    name: str
    offset: int
    ggml_type: int
    n_head: int
    n_rows: int
    n_cols: int
    head_stride: int
