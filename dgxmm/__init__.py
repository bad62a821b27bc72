"""The DGXMM application: configuration, engines, LiteLLM, the admin side and the command.

The rooms (`admin`, `engines`, `litellm`, `replay`) sit below what wires and starts them: the
composition root (`app`) and the command line (`cli`).  `config` reads the TOML file,
`demo` says what `serve --demo` changes, `private` keeps DGXMM's files to its own user.
"""
