"""``sglang-pic fleet``: several sglang-pic instances behind SGLang's router, sharing PTStore.

One server is what a benchmark measures; a deployment runs several instances behind a load
balancer, and that is where a shared prefix store pays: a document one instance computed is
loaded by another. SGLang's answer for a fleet is its router (PyPI ``sglang-router``: cache-aware
routing, retries, health checks, circuit breakers), so the fleet runs on it rather than beside
it, and starts the pieces a user would otherwise start by hand, in the right order, with one API
key and one store token:

* ``config``: the fleet's flags and every check made before anything starts (one line, exit 2);
* ``router``: the router's command line, and its HTTP calls (readiness, removing a dead worker);
* ``router_process``: the router's process, which takes the API key from the environment (never
  from a command line every user can read) and runs the router's own Python launcher;
* ``supervisor``: the child processes: start, readiness, death, and the drain-then-stop order;
* ``cli``: the command itself: the order of the starts, progress, the summary, signals.
"""
