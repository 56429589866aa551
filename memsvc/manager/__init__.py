"""The manager service: registry, tag policy, tiered idle timers, leases, budgets, telemetry; its
store (a SQLite file, or PostgreSQL shared by replicas of which one leads: ``store*.py``, ``replicas.py``).

The service's own code, not an import API (docs/python-api.md): call a manager through
``memsvc.ManagerClient`` or the ``memsvc.v1`` stubs. :mod:`memsvc.manager.inmemory` is the one part
meant for others' tests: an in-memory worker to run a manager against.

Its parts speak the manager's own types (``reports.py``: what workers report and what the manager
asks of them; ``records.py``: a worker's record and its frozen ``WorkerView``; ``policy.py``;
``watch.py``'s events); protos stay at the two edges, the servicer (``servicer.py``) and the gRPC
link to each worker (``links.py``), which translate through ``wire.py`` alone. ``controller.py``'s
``Manager`` builds and wires the parts and starts and stops them; the servicer calls the parts.

It builds on the shared layer alone (``memsvc.errors``, ``memsvc.vocabulary``, ``memsvc.runtime``,
the stubs), never on the worker or the gateway; only ``memsvc.cli`` (its command) and ``memsvc up``'s
host file (memsvc/_host.py: it checks a policy as the manager does and sends it as ``wire.py`` writes
it) import it. tests/test_package_layers.py holds all of that.
"""
