"""LiteLLM: the model entries DGXMM wants in a LiteLLM proxy, and keeping them there.

Owns `entries` (the entries DGXMM wants, rendered as LiteLLM reads them), `backend` (LiteLLM's
model API client and what both back-ends share), the two back-ends `sync` (LiteLLM's model API,
and the choice of back-end) and `filesync` (its config file, reloaded by `reload`), `gateway_key`,
and `bridge` (follows the controller and syncs).  May import `events`, `storage`,
`actors`, `gateway` and `dgxmm.config`; never `dgxmm.admin` or `dgxmm.engines`.
"""
