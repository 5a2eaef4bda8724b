"""Seams in SGLang's TokenizerManager (the HTTP server's process): what a request becomes before
the scheduler sees it, and what the manager shows of its configuration."""

from __future__ import annotations

from .seam import Seam

TITLE = "Tokenizer manager"

_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"

ROWS: tuple[Seam, ...] = (
    Seam(f"{_TM}.generate_request", "sglang_pic.security.request_validation:check_generate_request",
         "BEFORE", "request-validation",
         why="a wrong-typed or unknown sampling parameter is a 400 naming the field (SGLang: a "
             "500); runs before the span resolver"),
    Seam(f"{_TM}.generate_request", "sglang_pic.spans.request:resolve_generate_request",
         "BEFORE", "spans",
         why="span markers become padded ids and a layout (400 on bad input)"),
    Seam(f"{_TM}.init_tokenizer_and_processor", "sglang_pic.frontdoor:bound_model_max_length",
         "AFTER", "front-door",
         why="a tokenizer's \"no limit\" `model_max_length` becomes the model's context (SGLang's "
             "`/v1/tokenize` would return it in an int field: a 500)"),
    Seam(f"{_TM}.init_tokenizer_and_processor", "sglang_pic.spans.request:install_resolver",
         "AFTER", "spans",
         why="span markers become special tokens of the manager's tokenizer"),
    Seam(f"{_TM}._pic_span_resolver", "sglang_pic.spans.request:install_resolver", "attribute",
         "spans",
         why="the manager's span resolver"),
    Seam(f"{_TM}._validate_one_request",
         "sglang_pic.security.request_validation:check_tokenized_logprobs", "BEFORE",
         "request-validation",
         why="the logprob budget of a prompt once its tokens are known (a text prompt is "
             "estimated from its bytes before), with the new tokens its context leaves"),
    Seam(f"{_TM}._validate_one_request", "sglang_pic.sparse.admission:check_request_length",
         "BEFORE", "sparse-decode",
         why="with `--sparse-offload`, a request longer than its host region is a 400 naming the "
             "GiB (always registered: it reads the hand-off per request and returns at once "
             "without it)"),
    Seam(f"{_TM}.resolved_config_dict", "sglang_pic.security.redaction:redact_config", "AFTER",
         "secret-redaction",
         why="`/server_info` shows `api_key`, `admin_api_key`, `ssl_keyfile_password` as "
             "`<redacted>`"),
    Seam(f"{_TM}._dump_data_to_file", "sglang_pic.security.redaction:redacted_dump", "AROUND",
         "secret-redaction",
         why="request dumps pickle redacted server arguments and command line"),
    Seam(f"{_TM}.dump_requests_before_crash", "sglang_pic.security.redaction:redacted_dump", "AROUND",
         "secret-redaction",
         why="crash dumps likewise"),
    Seam(f"{_TM}.server_args", "sglang_pic.security.redaction:redacted_dump", "instance-patch",
         "secret-redaction",
         why="the redacted copy stands in for the manager's `server_args` (and `sys.argv`) "
             "while a dump is built"),
)
