"""The soaks behind `python -m trio_sessions.soak` (private; `trio_sessions.soak` is the entry).

* `sqlite`: worker processes on one SQLite file, SIGKILLed at random, and an audit;
  `sqliteworker` is its worker process.
* `postgres`: worker processes as hosts, each reaching PostgreSQL through its own fault
  proxy (`proxy`), under kills, pauses, partitions, connection kills, clock skew and a
  server restart; `audit` holds the checks (drain overlaps on one monotonic clock, lost
  inputs, orphaned claims, zombie writes). `postgres` is the command (producer, sampling,
  phases, report); `pgworker` the worker process, `pgchaos` the faults, `pgstate` the
  parent's shared state and figures.
* `pgserver`: the throwaway PostgreSQL server the soak (and the test suite) starts.
* `broken`: copies of the package with one deliberate defect each, to show which audit
  figure catches it.
* `common`: what both soaks share: the drain's answer, the worker's runtime loop and
  config, starting, restarting and stopping workers, the audit's answered-input checks.

Nothing here is imported by the library itself.
"""
