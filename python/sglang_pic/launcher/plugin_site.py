"""Our plugin made discoverable to SGLang where sglang-pic runs from a source tree.

SGLang loads plugins in every process it starts (scheduler, detokenizer, tokenizer manager)
from the ``sglang.srt.plugins`` entry point group (``sglang.srt.plugins.load_plugins``). A
``pip install`` of sglang-pic declares ours. Run from a source tree instead (``python/`` on
``PYTHONPATH``, as on the device machine, where nothing is installed), ``import sglang_pic``
works but no entry point names it: SGLang's processes then start without our plugin, and a flag
only our plugin adds (``--attention-backend pic_flashinfer``) is refused by SGLang's parser.

``plugin_env`` fixes that for a server process: where the entry point is missing it writes a
minimal ``sglang_pic-<version>.dist-info`` (``METADATA`` and ``entry_points.txt``, nothing else)
into a folder and puts that folder, and the folder ``sglang_pic`` is imported from, first on
the child's ``PYTHONPATH``; ``importlib.metadata`` in every process SGLang starts then finds the
entry point, as after an install. The benchmark harness uses ``write_site`` for its sglang-pic
variants.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

from sglang_pic import environment

GROUP = "sglang.srt.plugins"
NAME = "sglang_pic"
TARGET = "sglang_pic.plugin:register"


def declared() -> bool:
    """Whether this interpreter's installed distributions declare our entry point."""
    return any(ep.name == NAME and ep.value == TARGET for ep in entry_points(group=GROUP))


def not_loaded_reason() -> str:
    """Why SGLang's ``load_plugins`` did not run our plugin in this process, as one line."""
    allowed = environment.read("SGLANG_PLUGINS") or ""
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if names and NAME not in names:
        return (f"sglang-pic's plugin was not loaded: SGLANG_PLUGINS={allowed!r} leaves out "
                f"{NAME!r}")
    return ("sglang-pic's plugin was not loaded: no 'sglang.srt.plugins' entry point names it "
            "(start the server with `sglang-pic serve`, which declares it for a source tree, "
            "or pip install sglang-pic)")


def write_site(root: Path) -> Path:
    """``root`` holding a ``sglang_pic-<version>.dist-info`` that declares our entry point: a
    folder that, on ``sys.path``, makes this source tree an installed distribution for
    ``importlib.metadata``. Returns ``root``."""
    from sglang_pic import __version__

    dist = root / f"sglang_pic-{__version__}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang-pic\nVersion: {__version__}\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\n{NAME} = {TARGET}\n")
    return root


def source_root() -> Path:
    """The folder ``sglang_pic`` is imported from (``python/`` in a source tree)."""
    return Path(__file__).resolve().parents[2]


def kernel_root() -> Path | None:
    """The folder ``sglang_pic_kernel`` (our GPU kernels) is imported from, where importable."""
    import importlib.util

    spec = importlib.util.find_spec("sglang_pic_kernel")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent.parent


def plugin_env(env: dict[str, str], site_dir: Path) -> dict[str, str]:
    """``env`` for a process that starts SGLang: unchanged where our entry point is installed;
    otherwise with ``write_site(site_dir)``, ``source_root()`` and ``kernel_root()`` put before
    the given ``PYTHONPATH`` (which is kept as it was)."""
    if declared():
        return env
    write_site(site_dir)
    ours = [str(site_dir), str(source_root())]
    kernels = kernel_root()
    if kernels is not None and str(kernels) not in ours:
        ours.append(str(kernels))
    env = dict(env)
    given = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(ours + ([given] if given else []))
    return env
