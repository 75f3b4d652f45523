"""dflash-ops: operate DFlash drafter training runs on Proxmox GPU hosts."""
