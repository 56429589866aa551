"""The manager service: registry, tag policy, tiered idle timers, leases, budgets, telemetry; its
store (a SQLite file, or PostgreSQL shared by replicas of which one leads: ``store*.py``, ``replicas.py``).

The service's own code, not an import API (docs/python-api.md): call a manager through
``memsvc.ManagerClient`` or the ``memsvc.v1`` stubs. :mod:`memsvc.manager.inmemory` is the one part
meant for others' tests: an in-memory worker to run a manager against.
"""
