"""Reaching a host: ssh config read the way `ssh` reads it (`config`) and the route through jump hosts or a proxy
command (`routing`), both pure; `transport` runs an argv locally or over SSH, the only effects and the only
paramiko connection."""
