"""The server flags sglang-pic adds to SGLang's, in one table: each flag's default, range, and
the environment variable that hands its value to SGLang's processes.

Why variables at all: SGLang starts its tokenizer, scheduler and detokenizer processes itself and
gives them only its own ``ServerArgs``; a child inherits the launcher's ``os.environ``, so that is
how our values reach the code that uses them (the span planner, the attention backends, the
eviction policy). The variables are that hand-off, not a second way to configure: the launcher
(``sglang-pic serve``, or SGLang's own launcher with our plugin) sets them from the flags. A
variable already in the environment, with no flag given, is kept (SGLang's Python ``Engine`` has no
flags of ours, so it is configured that way) and checked like the flag.

Each reader asks ``setting(flag)``, which parses the variable with the flag's own parser, so a value
means the same wherever it is read. Standard library only: ``--help`` and every check of a value
run before SGLang or torch is imported.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sglang_pic import environment
from sglang_pic.sparse.config import MAX_CANDIDATES as SPARSE_MAX_CANDIDATES
from sglang_pic.sparse.config import MAX_RESELECT_INTERVAL as SPARSE_MAX_RESELECT
from sglang_pic.sparse.config import MINIMUM as SPARSE_MINIMUM
from sglang_pic.sparse.config import SparseDecodeConfig


class BadValue(argparse.ArgumentTypeError):
    """A flag's value is outside its range; the message says what is allowed."""


class UsageError(SystemExit):
    """Flags the launcher refuses: one line, naming the user's flags, before anything is loaded.

    A ``SystemExit`` so that, uncaught, the process stops without a traceback; the launchers catch
    it to print ``<prog>: error: <message>`` and exit with status 2 (argparse's usage status)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# ---- value parsers: str -> value, BadValue with the allowed range otherwise -------------------


def integer(minimum: int = 0, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise BadValue(f"{raw!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"{minimum}-{maximum}"
            raise BadValue(f"{value} is out of range ({bounds})")
        return value
    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise BadValue(f"supports {', '.join(map(repr, choices))} (got {raw!r})")
        return raw
    return parse


_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")


def on_off(raw: str) -> bool:
    """``on``/``off`` on the command line; the variables also take 1/0 (what they were)."""
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    raise BadValue(f"{raw!r} is not on or off")


def marker_pair(raw: str) -> tuple[str, str]:
    """``SSEP,PDEP``: split at the first comma."""
    ssep, sep, pdep = raw.partition(",")
    if not sep or not ssep or not pdep or ssep == pdep:
        raise BadValue(f"{raw!r} is not two different non-empty markers SSEP,PDEP")
    return ssep, pdep


def decode_config(raw: str) -> tuple[int, int, int]:
    """``BLOCK_N,WARPS,STAGES`` of the position-free decode kernel's stage 1 (Triton needs powers
    of two for the tile and the warps)."""
    try:
        block_n, warps, stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise BadValue(f"{raw!r} is not three integers BLOCK_N,WARPS,STAGES") from None
    if block_n not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8, 16) \
            or not 1 <= stages <= 8:
        raise BadValue(f"{raw!r}: BLOCK_N is 16..256 and WARPS 1..16 (powers of two), "
                       "STAGES 1..8")
    return block_n, warps, stages


def not_a_regular_file(path: str) -> bool:
    """Whether ``path`` exists as something other than a regular file (a device, a pipe, a
    folder, a link): a file written by renaming a temporary one over it must not replace that
    (``/dev/null`` would become a file)."""
    return os.path.islink(path) or os.path.lexists(path) and not os.path.isfile(path)


def in_writable_directory(path: str) -> None:
    """A file the scheduler will (re)write: its directory must exist and be writable, and the
    path must be a regular file or nothing yet (``not_a_regular_file``)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise BadValue(f"{path!r}: no writable directory {directory}")
    if not_a_regular_file(path):
        raise BadValue(f"{path!r}: not a regular file (each write replaces it)")


def directories(raw: str) -> tuple[str, ...]:
    """``DIR[,DIR...]``: existing folders, absolute."""
    out = []
    for part in raw.split(","):
        if not part.strip():
            raise BadValue(f"{raw!r}: an empty folder name")
        if not os.path.isdir(part):
            raise BadValue(f"{part!r} is not an existing folder")
        out.append(os.path.abspath(part))
    return tuple(out)


def text(raw: str) -> str:
    if not raw.strip():
        raise BadValue("an empty value")
    return raw


# ---- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    name: str
    """The command-line flag, e.g. ``--span-schedule``."""
    feature: str
    """Key of ``FEATURES``: the help group, and what must be on for the flag to mean anything."""
    help: str
    parse: Callable[[str], Any] | None = None
    """None: a switch without a value."""
    default: Any = None
    default_text: str | None = None
    """How ``--help`` states a default that is not a value (e.g. "the model's")."""
    range: str = ""
    """The allowed values, as ``--help`` shows them."""
    metavar: str | None = None
    env: str | None = None
    """The variable that hands the value to SGLang's processes (None: the launcher turns the flag
    into SGLang flags instead)."""
    hidden: bool = False
    launch_check: Callable[[Any], None] | None = None
    """Checked by the launcher only (readers in SGLang's processes take the value as it is and
    cope, e.g. a stats file that cannot be written turns the stats off)."""

    def from_argv(self, raw: str) -> Any:
        """``parse`` plus ``launch_check``: what the command line accepts."""
        value = self.parse(raw)
        if self.launch_check is not None:
            self.launch_check(value)
        return value

    def encode(self, value: Any) -> str:
        """The variable's text for ``value`` (what ``parse`` reads back)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        return self.show(value)

    @staticmethod
    def show(value: Any) -> str:
        """``value`` as the command line writes it."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return "none" if value is None else str(value)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Feature:
    title: str
    switch: str
    """What turns the feature on (named in the refusal of its knobs given alone)."""


FEATURES: dict[str, Feature] = {
    "api_key": Feature("HTTP API key (docs/security.md)", "sglang-pic serve"),
    "frontdoor": Feature("HTTP front door: limits and the admin API (docs/security.md)",
                         "sglang-pic serve"),
    "position_free": Feature("position-free KV", "--enable-position-free-kv "
                             "(or --enable-span-cache)"),
    "spans": Feature("span caching", "--enable-span-cache"),
    "ptstore": Feature("PTStore (HiCache L3 tier, span pages)", "--ptstore"),
    "hicache_storage": Feature("HiCache storage I/O", "--ptstore or --hicache-storage-backend"),
    "sparse": Feature("sparse decoding (ParisKV)", "--sparse-decode pariskv"),
    "sae": Feature("SAE eviction", "--radix-eviction-policy sae"),
    "tlru": Feature("T-LRU eviction", "--radix-eviction-policy tlru"),
}

_SPARSE_HELP = {
    "threshold": "context (tokens) from which a request decodes sparsely",
    "topk": "keys retrieved per KV head and step",
    "candidates": "keys kept by collision voting for the rerank",
    "sink": "always-attended first tokens",
    "local": "always-attended most recent tokens",
    "update": "window tokens moved to the retrieval region at once",
    "max_requests": "requests decoding sparsely at once (their metadata is allocated at start)",
    "max_context": "longest sparse context; 0: the model's",
    "reselect_interval": "decode steps one selection serves (1: select at every step)",
    "vote_interval": "decode steps one vote serves; the steps between rerank its candidates "
                     "(1: vote at every step)",
}
_SPARSE_RANGE = {"threshold": ">= sink + local + update",
                 "reselect_interval": f">= 1, <= {SPARSE_MAX_RESELECT}",
                 "vote_interval": f">= 1, <= {SPARSE_MAX_RESELECT}; not with the reselect "
                                  "interval",
                 "candidates": f">= topk, <= {SPARSE_MAX_CANDIDATES}",
                 "max_context": "0, or over the threshold"}


def _sparse_flags() -> list[Flag]:
    d = SparseDecodeConfig()
    out = []
    for field, what in _SPARSE_HELP.items():
        lo = SPARSE_MINIMUM[field]
        out.append(Flag(SparseDecodeConfig.flag(field), "sparse", what, parse=integer(lo),
                        default=getattr(d, field), range=_SPARSE_RANGE.get(field, f">= {lo}"),
                        metavar="N", env=SparseDecodeConfig.env_name(field)))
    return out


FLAGS: dict[str, Flag] = {f.name: f for f in [
    # sglang_pic.security.api_key: the key SGLang's --api-key check uses; without one of these sources
    # sglang-pic serve generates a key into a file (the path goes to stderr)
    Flag("--api-key-file", "api_key",
         "file holding the HTTP API key clients send (Authorization: Bearer KEY): a regular "
         "file of mode 600, one line of 16+ printable ASCII characters. First found: SGLang's "
         "--api-key KEY (visible in ps), this file, $SGLANG_PIC_API_KEY; none: a new key at "
         "each start in ~/.cache/sglang-pic/api-keys/PORT (the path is printed)",
         parse=text, metavar="PATH"),
    Flag("--insecure", "api_key",
         "serve without an API key: every process on this machine (with a --host beyond "
         "loopback, anyone who reaches the port) can use the server"),
    # sglang_pic.frontdoor: what the HTTP server admits
    Flag("--admin-api-key-file", "frontdoor",
         "file holding the admin key (mode 600, 16+ printable ASCII characters, not the API "
         "key): turns the admin endpoints on (weights, logging, profiling, flush, abort, "
         "pause); without it (or SGLang's --admin-api-key, or $SGLANG_PIC_ADMIN_API_KEY) they "
         "are refused to every client", parse=text, metavar="PATH"),
    Flag("--admin-path-root", "frontdoor",
         "folders (comma-separated) that paths in admin requests may name: profile output, "
         "dump folders, weights and adapters to load; none: such requests are refused",
         parse=directories, metavar="DIR[,DIR...]", env="SGLANG_PIC_ADMIN_PATH_ROOTS"),
    Flag("--enable-weights-from-tensor", "frontdoor",
         "let the admin key use /update_weights_from_tensor and "
         "/load_lora_adapter_from_tensors: SGLang unpickles their bodies, so whoever holds the "
         "admin key can run code on the server", default=False,
         env="SGLANG_PIC_WEIGHTS_FROM_TENSOR"),
    Flag("--max-request-mb", "frontdoor",
         "largest request body; a larger one is refused with 413 before it is read",
         parse=integer(1, 1024), default=16, range="1-1024", metavar="MB",
         env="SGLANG_PIC_MAX_REQUEST_MB"),
    Flag("--request-body-timeout-s", "frontdoor",
         "seconds a client has to send its whole body (408 after)",
         parse=integer(1, 3600), default=60, range="1-3600", metavar="S",
         env="SGLANG_PIC_BODY_TIMEOUT_S"),
    Flag("--http-header-timeout-s", "frontdoor",
         "seconds a connection has to send a complete request head, from its opening and "
         "from each response's end; then it is closed",
         parse=integer(1, 600), default=10, range="1-600", metavar="S",
         env="SGLANG_PIC_HEADER_TIMEOUT_S"),
    Flag("--http-write-timeout-s", "frontdoor",
         "seconds a response may wait for its client to read (the connection's buffers full) "
         "before the connection is closed and its request aborted",
         parse=integer(1, 3600), default=60, range="1-3600", metavar="S",
         env="SGLANG_PIC_WRITE_TIMEOUT_S"),
    Flag("--max-connections", "frontdoor",
         "open HTTP connections at most; a connection past it is closed at once",
         parse=integer(16, 1 << 20), default=1024, range="16-1048576", metavar="N",
         env="SGLANG_PIC_MAX_CONNECTIONS"),
    Flag("--enable-position-free-kv", "position_free",
         "a cached span's keys serve it at any offset: keys kept where computed, turned by the "
         "distance moved when read (selects the pic_ twin of --attention-backend: flashinfer "
         "-> pic_flashinfer, the GPU default; triton -> pic_triton; torch_native -> "
         "pic_torch_native)"),
    Flag("--position-free-span-graphs", "position_free",
         "pic_flashinfer: capture a second set of decode CUDA graphs for batches holding span "
         "requests, which otherwise decode eagerly: segmented attention in a padded layout "
         "(with the span cache; see --span-graph-runs), else our shift-aware Triton kernels",
         default=False, env="SGLANG_PIC_SPAN_GRAPHS"),
    Flag("--span-graph-runs", "position_free",
         "with --position-free-span-graphs: the most runs of keys (system prompt, each moved "
         "document, the rest: 12 holds ten documents) one request of a captured segmented "
         "decode step may have; a step with a request of more runs decodes eagerly. Each graph "
         "holds batch size x this many query rows, and their FlashInfer workspace takes ~0.36 "
         "MB per row (Llama-3-8B's heads)", parse=integer(1, 256), default=12, range="1-256", metavar="N",
         env="SGLANG_PIC_SPAN_GRAPH_RUNS"),
    Flag("--span-group-shared-runs", "position_free",
         "segmented attention's decode steps: auto reads the runs of keys that several requests "
         "hold (the same span, the same system prompt) once for all of them, as one request of "
         "the paged kernel, when that reads at most 3/4 of the step's keys; off reads each "
         "request's runs on its own", parse=one_of("auto", "off"), default="auto",
         metavar="{auto,off}", env="SGLANG_PIC_SPAN_GROUPS"),
    Flag("--span-copy-on-reuse", "position_free",
         "how a request reads a cached span placed at another offset. off: from the span's one "
         "shared copy, by segmented attention (each run of keys moved by one distance attended "
         "with the query turned back, merged by log-sum-exp: FlashInfer's kernels on a GPU); "
         "on: from its own copy of the span's pages, keys turned once, so its batches run "
         "vanilla attention and CUDA graphs, at the cost of pool memory per running request "
         "(it waits while less than 10 percent of the pool would stay free). auto: off",
         parse=one_of("auto", "on", "off"), default="auto", metavar="{auto,on,off}",
         env="SGLANG_PIC_SPAN_COPY"),
    Flag("--position-free-decode-config", "position_free",
         "stage-1 launch configuration of the GPU decode kernel",
         parse=decode_config, default=(64, 2, 3),
         range="BLOCK_N 16..256, WARPS 1..16, powers of two; STAGES 1..8",
         metavar="BLOCK_N,WARPS,STAGES", env="SGLANG_PIC_DECODE_CONFIG"),
    Flag("--enable-span-cache", "spans",
         "span caching (SSEP/PDEP markers, `spans` request field); implies "
         "--enable-position-free-kv and --radix-cache-backend pic_span"),
    Flag("--span-schedule", "spans",
         "isps: span prefills interleave with other work; ready-first: isps, but a prefill "
         "batch formed while span prefills and requests whose spans are cached both wait takes "
         "the latter alone (never twice in a row); barrier: final prompts wait until no span "
         "prefill is pending",
         parse=one_of("isps", "ready-first", "barrier"), default="isps",
         metavar="{isps,ready-first,barrier}",
         env="SGLANG_PIC_SPAN_SCHEDULE"),
    Flag("--span-recompute-tokens", "spans",
         "recompute the first K tokens of each span in context (link recompute)",
         parse=integer(0), default=0, range=">= 0", metavar="K",
         env="SGLANG_PIC_SPAN_RECOMPUTE_TOKENS"),
    Flag("--span-pad-token-id", "spans", "token that pads spans to whole pages",
         parse=integer(0), default_text="the tokenizer's pad, else eos", range=">= 0",
         metavar="ID", env="SGLANG_PIC_SPAN_PAD_TOKEN_ID"),
    Flag("--span-markers", "spans", "the marker strings in text prompts",
         parse=marker_pair, default=("<|ssep|>", "<|pdep|>"),
         range="two different non-empty strings", metavar="SSEP,PDEP",
         env="SGLANG_PIC_SPAN_MARKERS"),
    Flag("--ptstore", "ptstore",
         "store servers: PTStore as HiCache's L3 tier (with --enable-span-cache: the span pages' "
         "store)", parse=text, metavar="tcp://HOST:PORT,..."),
    Flag("--ptstore-token-file", "ptstore",
         "file with the PTStore token (else $SGLANG_PIC_PTSTORE_TOKEN); never on the command line",
         parse=text, metavar="PATH"),
    Flag("--ptstore-server-key", "ptstore",
         "the store servers' public key, when not derived from the token",
         parse=text, metavar="KEY"),
    Flag("--ptstore-trace", "ptstore",
         "one stderr line per PTStore lookup, load and store (wall clock, pages, hits, ms)",
         default=False, env="SGLANG_PIC_STORE_TRACE"),
    Flag("--hicache-storage-idle-yield-us", "hicache_storage",
         "while a HiCache storage load or write-back is in flight and nothing else runs, the "
         "scheduler sleeps this long per idle pass so the storage threads get the GIL (during a "
         "storage lookup it waits for the lookup's end instead, at most 2 ms); 0: off",
         parse=integer(0, 5000), default=100, range="0-5000", metavar="US",
         env="SGLANG_PIC_STORAGE_IDLE_YIELD_US"),
    # refused with its reason (argv is visible to every user), not reported as unknown
    Flag("--ptstore-token", "ptstore", "", parse=text, hidden=True),
    Flag("--sparse-decode", "sparse", "sparse decoding of requests over --sparse-threshold tokens",
         parse=one_of("pariskv"), metavar="pariskv"),
    *_sparse_flags(),
    Flag("--sparse-offload", "sparse",
         "retrieval-region KV in host memory, its GPU pool slots freed (turns prefix caching "
         "off)", default=False, env="SGLANG_PIC_SPARSE_OFFLOAD"),
    Flag("--sae-sample", "sae", "leaves scored per evict pass; 0: all of them",
         parse=integer(0), default=1024, range=">= 0", metavar="N", env="SGLANG_PIC_SAE_SAMPLE"),
    Flag("--sae-predictor", "sae",
         "the session predictor (off: each application's observed return rate)",
         parse=on_off, default=True, metavar="{on,off}", env="SGLANG_PIC_SAE_PREDICTOR"),
    Flag("--sae-queue-weights", "sae", "the per-queue weights alpha_q (the seed's sae-alpha)",
         parse=on_off, default=False, metavar="{on,off}", env="SGLANG_PIC_SAE_QUEUE_WEIGHTS"),
    Flag("--sae-stats", "sae",
         "write the policy's counters and timings to this JSON file after every evict pass",
         parse=text, range="a file in a writable directory", metavar="PATH",
         env="SGLANG_PIC_SAE_STATS", launch_check=in_writable_directory),
    # T-LRU's two settings (the paper's xi and Q_hat; SGLang's defaults, 0 and 0, make it LRU)
    Flag("--tlru-threshold", "tlru",
         "TTFT budget xi in uncached tokens: the tail of a conversation past history + "
         "--tlru-next-prompt-estimate - xi goes first (only xi - Q_hat matters; plain LRU "
         "unless xi > Q_hat)",
         parse=integer(0), default=0, range=">= 0", metavar="TOKENS",
         env="SGLANG_PIC_TLRU_THRESHOLD"),
    Flag("--tlru-next-prompt-estimate", "tlru",
         "Q_hat: tokens a conversation's next prompt is expected to add",
         parse=integer(0), default=0, range=">= 0", metavar="TOKENS",
         env="SGLANG_PIC_TLRU_NEXT_PROMPT_ESTIMATE"),
]}
for _flag in FLAGS.values():  # the hand-off variables, readable through the registry
    if _flag.env:
        environment.declare(_flag.env, "launcher.server_flags.FLAGS")


def _from_variable(flag: Flag, raw: str) -> Any:
    return on_off(raw) if flag.parse is None else flag.parse(raw)


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of flag ``name`` in this process: its variable parsed as the flag is, or the
    default. Raises ``ValueError`` naming the variable and the flag for a bad value."""
    flag = FLAGS[name]
    raw = environment.read(flag.env, environ) if flag.env else None
    if raw is None or raw == "":
        return flag.default
    try:
        return _from_variable(flag, raw)
    except BadValue as e:
        raise ValueError(f"${flag.env} (the hand-off of {flag.name}): {e}") from None


# ---- the parser --------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error in one line (no usage block) and stops with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message.removeprefix("argument "))


class _HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Our flags, one argument group per feature, on ``parser`` (in table order)."""
    groups: dict[str, Any] = {}
    for flag in FLAGS.values():
        if flag.feature not in groups:
            title = f"sglang-pic: {FEATURES[flag.feature].title}"
            groups[flag.feature] = parser.add_argument_group(title)
        group = groups[flag.feature]
        if flag.hidden:
            group.add_argument(flag.name, dest=flag.dest, help=argparse.SUPPRESS)
            continue
        line = flag.help
        if flag.parse is not None:
            shown = flag.default_text or flag.show(flag.default)
            line += f" (default {shown}; {flag.range})" if flag.range else f" (default {shown})"
        if flag.env:
            line += f" [${flag.env}]"
        line = line.replace("%", "%%")  # argparse formats help with %
        if flag.parse is None:
            group.add_argument(flag.name, dest=flag.dest, action="store_true", default=None,
                               help=line)
        else:
            group.add_argument(flag.name, dest=flag.dest, type=flag.from_argv,
                               metavar=flag.metavar, default=None, help=line)


def parser(prog: str = "sglang-pic serve") -> OneLineParser:
    p = OneLineParser(prog=prog, add_help=False, allow_abbrev=False,
                      formatter_class=_HelpFormatter)
    add_arguments(p)
    return p


def parse(argv: list[str], prog: str = "sglang-pic serve") -> tuple[dict[str, Any], list[str]]:
    """Split ``argv`` into our flags (``{flag name: value}``, only those given; a switch is True)
    and the rest (SGLang's flags, in order). Raises ``UsageError`` for a bad value."""
    namespace, rest = parser(prog).parse_known_args(argv)
    given = {f.name: getattr(namespace, f.dest) for f in FLAGS.values()
             if getattr(namespace, f.dest) is not None}
    return given, rest


def help_text(prog: str = "sglang-pic serve") -> str:
    """Our flags as ``--help`` shows them (argparse's layout, our groups only)."""
    p = parser(prog)
    formatter = p._get_formatter()
    for group in p._action_groups[2:]:  # [0], [1]: argparse's empty default groups
        formatter.start_section(group.title)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
    return formatter.format_help()


# ---- the hand-off ------------------------------------------------------------------------------


def handed_over(given: Mapping[str, Any],
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set for the flags in ``given`` (only those with a variable). Variables
    already in ``environ`` for flags not given are checked; a bad one raises ``UsageError``."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for flag in FLAGS.values():
        if not flag.env:
            continue
        if flag.name in given:
            out[flag.env] = flag.encode(given[flag.name])
        elif environment.read(flag.env, env):
            try:
                value = _from_variable(flag, environment.read(flag.env, env))
                if flag.launch_check is not None:
                    flag.launch_check(value)
            except BadValue as e:
                raise UsageError(f"${flag.env} in the environment (the hand-off of {flag.name}; "
                                 f"pass the flag instead): {e}") from None
    return out
