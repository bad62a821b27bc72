"""The admin side: the JSON API, users and sessions, live updates, metrics and the web UI.

Owns `api` (routes under `/dgxmm/api/...`), `auth` (users, passwords, sessions, tokens), `sse`
(Server-Sent Events for the UI), `metrics` (Prometheus exposition) and `web/` (static files).
May import `events`, `storage`, `actors`, `gateway`, `dgxmm.config`, `dgxmm.replay`,
`dgxmm.engines` and `dgxmm.litellm`; nothing else in `dgxmm` imports it except the
composition root (`dgxmm.app`).
"""
