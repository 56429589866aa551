"""The manager service: registry, tag policy, tiered idle timers, leases, budgets, telemetry."""
