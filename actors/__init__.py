"""The actors: deployments' lifecycles, the request queue and the memory budget, on one runtime.

The runtime (`runtime`); the deployment actors (`deployment`, `readiness`, `cold_start`), the
queue (`queue`), the memory broker (`memory_broker`) and watchdog (`watchdog`), wired by the
controller (`controller`); what the gateway asks of them (`admission`) and the protocols
`dgxmm` implements for them (`ports`).
"""
