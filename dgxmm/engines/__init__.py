"""Engines: how vLLM, llama.cpp, SGLang and the simulated engine are launched, probed and run.

Owns `adapters` (command lines, health, metrics and sleep state per engine, probed through
`gateway.client`), `memory` (how much memory the box has and has free) and `runtimes/`
(Docker and local processes).  Implements the ports `actors` declares.  May import `events`,
`storage`, `actors`, `gateway` and `dgxmm.config`; never `dgxmm.admin` or `dgxmm.litellm`.
"""
