"""Pure numeric helpers shared by the reference (the oracle) and the runtime (spec `model.md` §3).

Torch only: rounding and FP8/FP4 fake quantisation (`rounding`), RoPE tables and rotation
(`rope`), cache/activation profiles (`profile`), and the geometry of ids, windows and
visibility (`geometry`). No device dispatch, no backends: each function is one formula.
"""
