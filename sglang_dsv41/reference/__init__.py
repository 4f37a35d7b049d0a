"""Pure-PyTorch reference of DeepSeek-V4.1 (the oracle every runtime path is tested against)."""
