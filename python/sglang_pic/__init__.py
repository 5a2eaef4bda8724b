"""sglang-pic: an SGLang distribution for span-heavy serving.

Importing this package is cheap on purpose (it runs in every SGLang process through the
plugin entry point); the capabilities live in subpackages that are imported on demand.
"""

__version__ = "0.1.0"
