"""DeepSeek-V4.1 chat API on SGLang 0.5.17: thinking/effort per the model card, prompt encoding
through deepseek-recipe, reasoning and DSML tool-call parsers (docs/api.md).

Modules that import SGLang (heavy) are `reasoning_parser`, `tool_parser`, `serving`,
`register`; `effort`, `encoding`, `prompt_tokens`, `dsml`, `think`, `dsml_grammar` and
`http_middleware` do not (`dsml_grammar` imports xgrammar).
"""
