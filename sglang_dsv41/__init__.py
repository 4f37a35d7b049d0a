"""sglang-dsv41: serve DeepSeek-V4.1-Flash on stock SGLang 0.5.17."""

__version__ = "0.1.0"
