"""The test suite as a package: tests/moe_service and tests/pipeline mirror the source trees,
tests/bench the benchmarks' plumbing, tests/e2e the service as a subprocess, tests/support the
shared helpers (imported as ``tests.support.<module>``). The labs (tests/lab, tests/numa,
tests/systemd) run in a VM or container and are referenced by path."""
