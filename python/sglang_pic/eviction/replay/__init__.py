"""Replaying request traces through SGLang's own radix cache, to compare eviction policies
without a server.

| module | what it is |
|---|---|
| ``traces`` | request traces: synthetic generators (chat, agent, single-turn, their mixes) and the Mooncake and Qwen-Bailian loaders |
| ``simulator`` | the replay: SGLang's ``RadixCache`` with the policy under test, a counting allocator and a virtual clock; hit rate, estimated TTFT, policy time |

The benchmarks in ``benchmark/eviction/`` (``bench_eviction.py``, ``replay_trace.py``, ...) run
these over families of workloads and traces and write the reports.
"""
