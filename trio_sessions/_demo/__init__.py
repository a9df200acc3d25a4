"""The body of `python -m trio_sessions.demo` (private; `trio_sessions.demo` is the entry).

* `output`: timestamped lines, scene titles, one readable line per transcript message.
* `agent`: the scripted fake agent (a drain) and its fake tools.
* `scenes`: the five scenes, the facts they observe, their raw SQL reads and the corrupt
  record of scene 5.
* `checks`: the summary, every check computed from the database.
* `run`: the command line, the run of every scene under Ctrl-C, scene 4's worker process.

Dependencies point one way: output <- agent <- scenes <- checks <- run. Nothing here is
imported by the library itself.
"""
