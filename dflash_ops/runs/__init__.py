"""Runs on a target: the bash that creates, lists, reads and stops them (`shellcmd` and the `*_scripts` modules)
and the parsers of what it prints (`parse`, `manifest`), all pure; runbook YAML -> RunSpec (`runbooks`); the use
cases that send them through a Transport (`lifecycle`: launch, list, find, stop; `follow`; `pull`)."""
