"""The tiny models' dimensions, and the recipe's two keys that are not config fields.

Shared by the recipe (``tiny``) and the per-type fixes (``fixes``), so that neither imports the other's
module for a number. Pure constants: imports nothing.
"""

from __future__ import annotations

HIDDEN = 64
LAYERS = 6
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 256
FFN = 128
POSITIONS = 128

#: Recipe keys that are not config fields: nested sub-config recipes, and the sub-config to build from.
SUB_CONFIGS = "__sub_configs__"
BUILD_FROM = "__build_from__"
