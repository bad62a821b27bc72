"""LiteLLM: the model entries DGXMM wants in a LiteLLM proxy, and keeping them there.

Owns `sync` (the desired entries and the two back-ends: LiteLLM's model API and its config
file) and `bridge` (follows the controller and syncs).  May import `events`, `storage`,
`actors`, `gateway` and `dgxmm.config`; never `dgxmm.admin` or `dgxmm.engines`.
"""
