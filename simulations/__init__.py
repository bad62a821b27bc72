"""Simulations: the real actors on a virtual clock, with simulated engines and traffic.

The simulated engine (`engine`, `answers`, `refusals`) and runtime (`runtime`); the harness
(`harness`), scenarios (`scenarios`), invariants (`properties`) and fairness report
(`fairness`); the what-if (`whatif`, `whatif_history`, `whatif_run`, `whatif_measure`) and
`tune` on top of it.
"""
