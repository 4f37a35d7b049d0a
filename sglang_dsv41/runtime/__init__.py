"""Torch-path runtime of DeepSeek-V4.1 inside SGLang 0.5.17 (see docs/runtime.md)."""
