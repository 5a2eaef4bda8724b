"""Starting a server: our flags, their checks, and the processes that run SGLang with our plugin.

| module | what it is |
|---|---|
| ``server_flags`` | the table of the flags sglang-pic adds to SGLang's (defaults, ranges, the variable that hands each to SGLang's processes), and ``setting`` for the code that reads them |
| ``serve_conflicts`` | flag combinations we cannot serve, refused from the command line alone |
| ``sglang_flags`` | SGLang's flag names without importing SGLang (a cached file), and our help beside SGLang's |
| ``launch_server`` | ``sglang-pic serve``: our flags checked and turned into SGLang's argv, then the server process |
| ``server_process`` | the SGLang server process that ``sglang-pic serve`` starts and waits for |
| ``sglang_launcher`` | our flags in SGLang's own launchers (``python -m sglang.launch_server``), through the plugin |
| ``plugin_site`` | our plugin made discoverable to SGLang's processes when running from a source tree |
| ``default_model`` | the embedded SmolLM2-135M-Instruct, converted once from its GGUF |

Nothing here is imported by SGLang's processes except ``server_flags`` (the readers of our
settings) and ``sglang_launcher`` (through the plugin's seams).
"""
