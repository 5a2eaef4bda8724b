"""The documentation's examples, run against one fresh CPU server.

Every fenced ``bash``/``sh``/``shell``/``python`` block of README.md and docs/*.md is one test case
(id ``file:line``), so an example that stopped working (a missing header, a flag that moved, a
command that needs the venv) fails here instead of on a reader's machine. What runs is decided by
an HTML comment on the line before the block, or else by the block itself:

* ``<!-- docs-check: skip (reason) -->``: not run; the reason (device-only, long, starts a server,
  a synopsis with placeholders) is the skip message, so ``pytest -rs`` lists it;
* ``<!-- docs-check: run -->``: run, although it does not talk to the server (a quick CLI line);
* ``<!-- docs-check: expect "REGEX" -->``: run, and its output must match ``REGEX``;
* no comment: run when it talks to the server the docs assume (``localhost:30000`` /
  ``127.0.0.1:30000``), skipped otherwise (nothing to check it against).

The server is started once for the module with ``--enable-span-cache`` on a free port (a span
server answers plain requests too; without it on a release that does not serve spans, whose span
examples are skipped: ``ASKS_FOR``), and ``:30000`` in a block is rewritten to it. It is given no
API key, so it generates one into its key file as ``make serve`` does, and the key file of port
30000 the examples read (``~/.cache/sglang-pic/api-keys/30000``) is rewritten to that file, which
is removed when the module ends. A block passes
when it exits 0, every ``curl`` in it got HTTP 200 with a JSON answer that carries generated text
where one is expected, a Python block printed something, and ``expect`` matched. Blocks run in
document order in one module (the span examples' "now cached" claims rely on it), with
``$TMPDIR`` set to a scratch folder and ``.venv/bin/`` meaning this interpreter's folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, Server, start_server, stop_server, use_generated_key
from sglang_pic.security import api_key

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
SERVER_RE = re.compile(r"\b(?:localhost|127\.0\.0\.1):30000\b")
KEY_FILE = "~/.cache/sglang-pic/api-keys/30000"
"""The key file of ``make serve``'s server, as the examples read it."""
MARKER_RE = re.compile(r"<!--\s*docs-check:\s*(.*?)\s*-->")
DIRECTIVE_RE = re.compile(r'^(?:skip \((?P<reason>[^)]+)\)|run|expect "(?P<expect>[^"]+)")$')
STATUS = "[docs-check] HTTP"
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    """One fenced code block and the ``docs-check`` comment before it (None: no comment)."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "bash" or "python"
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def talks_to_server(self) -> bool:
        """Whether code outside comments names the server's address (README's ``make serve``
        line names it in a comment: it starts a server, it does not talk to one)."""
        code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in self.code.splitlines())
        return bool(SERVER_RE.search(code))


def extract_blocks(path: Path) -> list[Block]:
    """The shell and Python blocks of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```\s*(\w+)?\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        lang = LANGS.get((fence.group(1) or "").lower())
        if lang is not None:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER_RE.search(before)
            blocks.append(Block(path, i + 1, lang, "\n".join(lines[i + 1 : end]) + "\n",
                                marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = [b for doc in DOCS for b in extract_blocks(doc)]


def test_docs_check_comments_are_well_formed() -> None:
    """A misspelt comment would silently change what runs: every ``docs-check`` comment in the
    docs is one of the three forms and stands right before a shell or Python block."""
    attached = {(b.path, b.marker) for b in BLOCKS if b.marker is not None}
    problems = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in MARKER_RE.finditer(line):
                where = f"{doc.relative_to(REPO)}:{n}"
                if not DIRECTIVE_RE.match(m.group(1)):
                    problems.append(f"{where}: unknown directive {m.group(1)!r}")
                elif (doc, m.group(1)) not in attached:
                    problems.append(f"{where}: not right before a bash/python block")
    assert not problems, "\n".join(problems)


ASKS_FOR = {
    "eviction_with_hicache": re.compile(
        r"--radix-eviction-policy +(?:auto|sae|gdsf|s3fifo|tlru)\b.*"
        r"(?:--enable-hierarchical-cache|--ptstore)", re.DOTALL),
}
"""What in a block asks for a capability a supported release may lack (``compat.gaps``): such a
block is skipped there with the gap's line."""


def _gap_of(block: Block):
    from sglang_pic.compat import gaps

    return next((found for capability, asks in ASKS_FOR.items()
                 if asks.search(block.code) and (found := gaps.gap(capability)) is not None),
                None)


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from sglang_pic.compat import gaps

    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    spans = [] if gaps.gap("spans") else ["--enable-span-cache"]
    srv = start_server([*spans, "--max-total-tokens", "16384"], log, pass_key=False)
    key_file = use_generated_key(srv)
    yield srv
    stop_server(srv)
    key_file.unlink(missing_ok=True)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    directive = DIRECTIVE_RE.match(block.marker) if block.marker is not None else None
    if directive and directive.group("reason"):
        pytest.skip(f"{block.id}: marked: {directive.group('reason')}")
    if directive is None and not block.talks_to_server:
        pytest.skip(f"{block.id}: not a server example and not marked `docs-check: run`")
    if (gap := _gap_of(block)) is not None:
        pytest.skip(f"{block.id}: {gap.message('the example')}")
    code = block.code
    if block.talks_to_server:
        server: Server = request.getfixturevalue("docs_server")
        code = SERVER_RE.sub(server.url.removeprefix("http://"), code)
        code = code.replace(KEY_FILE, str(use_generated_key(server)))
    out = run_block(block.lang, code, tmp_path)
    if block.lang == "bash":
        check_curl_answers(out)
    else:
        assert out.strip(), "a Python example must print what it shows"
    expect = directive.group("expect") if directive else None
    if expect:
        assert re.search(expect, out), f"output does not match {expect!r}:\n{out[-3000:]}"


def run_block(lang: str, code: str, tmp_path: Path) -> str:
    """Run a block as a reader would, from the repository root; return its stdout."""
    bin_dir = Path(sys.executable).parent
    code = code.replace(".venv/bin/", f"{bin_dir}/")
    env = dict(os.environ, TMPDIR=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop(api_key.ENV, None)  # the examples find the key as a reader's shell would: its file
    if lang == "bash":
        # every curl also prints its HTTP status on a line of its own, checked afterwards
        preamble = (f"set -eo pipefail\ncurl() {{ command curl --max-time {BLOCK_TIMEOUT_S} "
                    f"-w '\\n{STATUS} %{{http_code}}\\n' \"$@\"; }}\n")
        cmd = ["bash", "-c", preamble + code]
    else:
        script = tmp_path / "example.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    # its own process group, so that a block that overruns is stopped with everything it started
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running after {BLOCK_TIMEOUT_S} s\nstdout:\n{stdout[-3000:]}\n"
                    f"stderr:\n{stderr[-3000:]}")
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
    return stdout


def check_curl_answers(out: str) -> None:
    """Each curl answered 200 with JSON; generation endpoints with non-empty text."""
    parts = re.split(rf"^{re.escape(STATUS)} (\d+)$", out, flags=re.M)
    for body, status in zip(parts[0::2], parts[1::2], strict=False):
        assert status == "200", f"HTTP {status}: {body.strip()[-2000:]}"
        answer = json.loads(body)
        text = generated_text(answer)
        assert text is None or text.strip(), f"empty generation: {body.strip()[-2000:]}"


def generated_text(answer: object) -> str | None:
    """The generated text of a /generate or OpenAI answer; None for other endpoints."""
    if isinstance(answer, list):
        return "".join(generated_text(a) or "" for a in answer)
    if not isinstance(answer, dict):
        return None
    if "text" in answer and "meta_info" in answer:
        return answer["text"]
    choices = answer.get("choices")
    if isinstance(choices, list) and choices:
        first = choices[0]
        message = first.get("message") or {}
        return message.get("content") or first.get("text") or ""
    return None
