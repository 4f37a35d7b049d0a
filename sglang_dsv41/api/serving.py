"""Hook implementations that put DeepSeek-V4.1 on SGLang 0.5.17's OpenAI chat path
(spec `runtime.md` §A.10 and §B "Chat template / encoding"). The targets and hook types are
declared in `sglang_dsv41.hooks`; this module only holds the functions.

Flow of one ``/v1/chat/completions`` request for a model whose ``model_type`` is
``deepseek_v41`` (chat encoding spec ``dsv41``):

1. (HTTP only) `http_middleware.ChatReasoningMiddleware` validates and canonicalises the raw
   reasoning fields (installed by `setup_http_server_hook`).
2. `convert_to_internal_request_hook` resolves thinking/effort (`effort.resolve_reasoning`, with
   the server's ``--default-chat-template-kwargs``), writes the decision into the request
   (``chat_template_kwargs.thinking`` = ``enable_thinking`` = decision, top-level effort cleared,
   ``skip_special_tokens=False`` so ``</think>`` and ``｜DSML｜`` reach the parsers) and keeps it
   for step 3 in a context variable; then runs SGLang's conversion.
3. `apply_jinja_template_hook` renders the prompt with `encoding.render_chat` and encodes it
   with `prompt_tokens.PromptTokenEncoder` (token ids; images as SGLang `ImageData`).
4. Back in step 2: for multimodal servers SGLang would re-tokenise the prompt *text*; the hook
   hands the ids over instead (user text stays plain text).
5. `get_reasoning_from_request_hook` / `reasoning_parser_init_hook` make the reasoning parser
   and the reasoning grammar use the decision, whatever the tokenizer's chat template says.

Bad input (issue 20; `request_guard`): steps 2 and the completion hook check the top-logprob
count, ``n`` and — on the converted request — token ids, prompt length, sampling parameters and
media before the request is queued or its stream starts; `validate_one_request_hook` re-checks
the ids on every path into the scheduler; `setup_http_server_hook` also installs
`http_guard` (``/generate`` guard, error-path scrubbing) and names the model.

Every rule violation raises `ValueError` (SGLang answers HTTP 400).
"""
from __future__ import annotations

import contextvars
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from .effort import (
    ReasoningDecision,
    effort_table_from_env,
    read_request_reasoning,
    resolve_reasoning,
    validate_server_defaults,
)
from .encoding import encode_chat, render_chat, task_decision
from .prompt_tokens import PromptTokenEncoder
from .request_guard import (
    ServingLimits,
    check_adapted_request,
    check_choice_count,
    check_token_ids,
    check_top_logprobs,
)
from .reasoning_parser import PARSER_NAMES as REASONING_PARSER_NAMES
from .tool_parser import PARSER_NAMES as TOOL_PARSER_NAMES

logger = logging.getLogger(__name__)

SPEC = "dsv41"
MODEL_TYPE = "deepseek_v41"


@dataclass
class _Conversion:
    """State of one request while SGLang converts it (decision in, prompt ids out)."""

    decision: ReasoningDecision
    prompt_ids: list[int] | None = None


_CURRENT: contextvars.ContextVar[_Conversion | None] = contextvars.ContextVar(
    "sglang_dsv41_chat_conversion", default=None)


def is_dsv41_config(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == MODEL_TYPE


def _is_ours(serving: Any) -> bool:
    return getattr(serving, "chat_encoding_spec", None) == SPEC


# -- resolve_chat_encoding_spec (AROUND) --------------------------------------------------------
def resolve_chat_encoding_spec_hook(original, *args, **kwargs):
    """``dsv41`` for a DeepSeek-V4.1 config (its arch reads DeepseekV4, which would select the
    V4 encoder); everything else unchanged."""
    hf_config = kwargs.get("hf_config", args[0] if args else None)
    if is_dsv41_config(hf_config):
        return SPEC
    return original(*args, **kwargs)


# -- OpenAIServingChat.__init__ (AFTER) ---------------------------------------------------------
def serving_chat_init_hook(result, self, *args, **kwargs):
    """Fail at start-up on a configuration that would silently mis-serve V4.1; build the
    prompt-token encoder and read the effort table once."""
    if not _is_ours(self):
        return None
    tool_parser, reasoning_parser = self.tool_call_parser, self.reasoning_parser
    if tool_parser not in (None, *TOOL_PARSER_NAMES):
        raise ValueError(f"DeepSeek-V4.1 emits DSML tool calls; --tool-call-parser {tool_parser!r} "
                         f"cannot parse them, use one of {list(TOOL_PARSER_NAMES)}")
    if reasoning_parser not in (None, *REASONING_PARSER_NAMES):
        raise ValueError(f"use --reasoning-parser {REASONING_PARSER_NAMES[0]} for DeepSeek-V4.1, "
                         f"not {reasoning_parser!r}")
    if self.template_manager.chat_template_name is not None:
        raise ValueError("DeepSeek-V4.1 prompts are rendered by deepseek-recipe; remove "
                         f"--chat-template {self.template_manager.chat_template_name!r}")
    self._dsv41_table = effort_table_from_env()
    validate_server_defaults(self.default_chat_template_kwargs, self._dsv41_table)
    self._dsv41_encoder = PromptTokenEncoder(self.tokenizer_manager.tokenizer)
    logger.info("DeepSeek-V4.1 chat API: effort table %r, parsers reasoning=%s tools=%s",
                self._dsv41_table.name, reasoning_parser, tool_parser)
    return None


def _decide(serving: Any, request: Any) -> ReasoningDecision:
    return resolve_reasoning(chat_template_kwargs=request.chat_template_kwargs,
                             top_level_effort=request.reasoning_effort,
                             table=serving._dsv41_table,
                             server_defaults=serving.default_chat_template_kwargs)


def _thinking_requested(serving: Any, request: Any) -> bool:
    """True when the request itself turns thinking on (toggle or effort), defaults aside."""
    if request.task in (None, "action"):
        return False
    said = read_request_reasoning(request.chat_template_kwargs, request.reasoning_effort,
                                  serving._dsv41_table)
    return said.thinking is True


# -- OpenAIServingChat._convert_to_internal_request (AROUND) ------------------------------------
def convert_to_internal_request_hook(original, self, request, raw_request=None):
    if not _is_ours(self):
        return original(self, request, raw_request)
    check_top_logprobs(request.top_logprobs, "top_logprobs")
    check_choice_count(request.n, "n")
    decision = task_decision(_decide(self, request), request.task,
                             thinking_requested=_thinking_requested(self, request))
    ctk = dict(request.chat_template_kwargs or {})
    ctk.pop("reasoning_effort", None)
    ctk["thinking"] = ctk["enable_thinking"] = decision.thinking
    request.chat_template_kwargs = ctk
    request.reasoning_effort = None
    request.skip_special_tokens = False
    conversion = _Conversion(decision)
    token = _CURRENT.set(conversion)
    try:
        adapted, processed = original(self, request, raw_request)
    finally:
        _CURRENT.reset(token)
    if conversion.prompt_ids is not None and getattr(adapted, "input_ids", None) is None:
        adapted.text = None  # SGLang's multimodal branch passed the prompt text; use our ids
        adapted.input_ids = conversion.prompt_ids
    check_adapted_request(adapted, ServingLimits.of(self.tokenizer_manager))
    return adapted, processed


def _serves_dsv41(tokenizer_manager: Any) -> bool:
    return is_dsv41_config(getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None))


# -- OpenAIServingCompletion._convert_to_internal_request (AROUND) ------------------------------
def completion_convert_hook(original, self, request, raw_request=None):
    """`/v1/completions`: the client's ``logprobs`` count, token-id prompts and sampling
    parameters are checked (`request_guard`) before the request is queued or streamed."""
    if not _serves_dsv41(self.tokenizer_manager):
        return original(self, request, raw_request)
    check_top_logprobs(request.logprobs, "logprobs")
    check_choice_count(request.n, "n")
    adapted, processed = original(self, request, raw_request)
    check_adapted_request(adapted, ServingLimits.of(self.tokenizer_manager))
    return adapted, processed


# -- TokenizerManager._validate_one_request (BEFORE) --------------------------------------------
def validate_one_request_hook(self, obj, input_ids, *args, **kwargs):
    """Last line for every path into the scheduler (HTTP, the Python Engine, batches, text
    prompts): the ids about to be queued are in the vocabulary. SGLang's own length check follows
    (it may truncate, so length is not checked here)."""
    if input_ids is not None and _serves_dsv41(self):
        check_token_ids(list(input_ids), "input_ids", ServingLimits.of(self), check_length=False)


# -- OpenAIServingChat._apply_jinja_template (AROUND) -------------------------------------------
def apply_jinja_template_hook(original, self, request, tools, is_multimodal):
    if not _is_ours(self):
        return original(self, request, tools, is_multimodal)
    from sglang.srt.entrypoints.openai.protocol import MessageProcessingResult
    from sglang.srt.utils import ImageData

    conversion = _CURRENT.get()
    decision = conversion.decision if conversion is not None else _decide(self, request)
    response_format = (request.response_format.model_dump(by_alias=True)
                       if request.response_format is not None else None)
    tool_choice = request.tool_choice
    rendered = render_chat(
        [m.model_dump() for m in request.messages],
        decision=decision,
        tools=tools,
        tool_choice=tool_choice if isinstance(tool_choice, str) else "named",
        response_format=response_format,
        continue_final_message=request.continue_final_message,
        task=request.task,
    )
    ids = encode_chat(rendered, self._dsv41_encoder)
    if conversion is not None:
        conversion.prompt_ids = ids
    images = [ImageData(url=im.url, detail=im.detail) for im in rendered.images]
    return MessageProcessingResult(
        prompt=rendered.text,
        prompt_ids=ids,
        image_data=images or None,
        audio_data=None,
        video_data=None,
        modalities=["image"] * len(images),
        stop=request.stop,
    )


# -- OpenAIServingChat._get_reasoning_from_request (AROUND) -------------------------------------
def _canonical_thinking(request: Any) -> bool | None:
    ctk = getattr(request, "chat_template_kwargs", None) or {}
    value = ctk.get("thinking")
    if isinstance(value, bool) and ctk.get("enable_thinking") is value:
        return value
    return None


def get_reasoning_from_request_hook(original, self, request):
    if not _is_ours(self):
        return original(self, request)
    thinking = _canonical_thinking(request)
    return thinking if thinking is not None else _decide(self, request).thinking


# -- ReasoningParser.__init__ (AROUND) ----------------------------------------------------------
def reasoning_parser_init_hook(original, *args, **kwargs):
    """For our parser names, ``force_reasoning`` := the request's decision (a chat template that
    SGLang detected as always-thinking must not misroute a non-thinking reply), and the detector
    learns whether a tool parser will read the content (else it drops DSML markup itself)."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    model_type = bound.arguments.get("model_type")
    request = bound.arguments.get("request")
    ours = isinstance(model_type, str) and model_type.lower() in REASONING_PARSER_NAMES \
        and request is not None
    if ours:
        thinking = _canonical_thinking(request)
        if thinking is not None:
            bound.arguments["force_reasoning"] = thinking
    result = original(*bound.args, **bound.kwargs)
    if ours:
        bound.arguments["self"].detector.set_tool_parser_runs(_declares_tools(request))
    return result


def _declares_tools(request: Any) -> bool:
    """True when SGLang's chat serving hands this request's content to the tool-call parser:
    tools declared (on the request or a system/developer message) and ``tool_choice`` not
    ``none`` (`OpenAIServingChat._effective_tools`; a server without ``--tool-call-parser``
    returns the raw reply, docs/api.md)."""
    if getattr(request, "tool_choice", None) == "none":
        return False
    if getattr(request, "tools", None):
        return True
    return any(getattr(m, "role", None) in ("system", "developer") and getattr(m, "tools", None)
               for m in getattr(request, "messages", None) or [])


# -- TokenizerManager.sigterm_watchdog (AROUND) --------------------------------------------------
def sigterm_watchdog_hook(original, self):
    """V4.1 servers: bounded drain and exit status 0 on SIGTERM (`shutdown`); others unchanged.
    Both branches return the coroutine the manager schedules."""
    if not _serves_dsv41(self):
        return original(self)
    from .shutdown import drain_timeout_s, sigterm_watchdog_replacement

    drain_timeout_s()  # a bad SGLANG_DSV41_DRAIN_TIMEOUT_S fails the start-up, not the shutdown
    return sigterm_watchdog_replacement(self)


# -- http_server._setup_and_run_http_server (AROUND) --------------------------------------------
def setup_http_server_hook(original, *args, **kwargs):
    """Install `ChatReasoningMiddleware` on SGLang's app when the served model is V4.1."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    tokenizer_manager = bound.arguments.get("tokenizer_manager")
    hf_config = getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None)
    if is_dsv41_config(hf_config):
        from sglang.srt.entrypoints import http_server

        from .http_guard import install_http_guard

        install_chat_middleware(http_server.app)
        install_http_guard(http_server.app, lambda: ServingLimits.of(tokenizer_manager))
        _name_the_model(bound.arguments.get("server_args"), tokenizer_manager)
    return original(*args, **kwargs)


def _name_the_model(server_args: Any, tokenizer_manager: Any) -> None:
    """Without ``--served-model-name`` SGLang reports ``--model-path`` (a local path) as the model
    id; report the checkpoint's name instead (`model_name.public_model_name`)."""
    from .model_name import public_model_name

    if server_args is None or server_args.served_model_name != server_args.model_path:
        return  # the operator named the model
    # server_args is read-only once resolved; the tokenizer manager owns the name it reports
    tokenizer_manager.served_model_name = public_model_name(server_args.model_path)


def install_chat_middleware(app: Any) -> None:
    """Add the middleware to a FastAPI app (idempotent); must run before the app starts.

    It goes *innermost* among the user middleware (after CORS, request decompression, API-key
    checks), so its 400s carry CORS headers and it sees decompressed, authorised bodies.
    """
    from starlette.middleware import Middleware

    from .http_middleware import ChatReasoningMiddleware

    if any(m.cls is ChatReasoningMiddleware for m in app.user_middleware):
        return
    if app.middleware_stack is not None:
        raise RuntimeError("the HTTP app already started; the DeepSeek-V4.1 chat middleware must "
                           "be installed before serving")
    app.user_middleware.append(Middleware(ChatReasoningMiddleware, table=effort_table_from_env))
