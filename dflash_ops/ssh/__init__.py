"""Reaching a host. Pure: `config` (ssh config read the way `ssh` reads it), `routing` (jump hosts, a proxy
command), `endpoint` (a host's address, port, user, identity file and route; reads the config files). Effects:
`transport` (the contract and `for_host`), `local` (this machine's subprocesses), `connection` (the one paramiko
SSH connection per host, and the handshake of `trust-host`), `proxy` (a ProxyCommand as its socket), `hostkeys`
(known_hosts read as OpenSSH reads it, appended to by `trust-host`); `common` holds what both transports share.

paramiko is imported by `connection` and `proxy` (connections), `hostkeys` (parsing known_hosts' keys:
paramiko.PKey) and `config` (paramiko.SSHConfig's Host/Match lookup, no connection), each lazily, and by no other
module of dflash_ops (tests/test_layout.py checks it).
"""
